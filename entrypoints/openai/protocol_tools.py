"""Pydantic models of tool calling and structured outputs in the HTTP API (requests and responses).

Shapes follow the OpenAI API reference (``tools``, ``tool_choice``, ``message.tool_calls``,
``delta.tool_calls``) and vLLM's ``structured_outputs`` request object.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ----------------------------------------------------------------------------------------------- requests


class FunctionDefinition(_Model):
    """A function the model may call; ``parameters`` is a JSON schema of its arguments (``None``: no arguments)."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolParam(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(_Model):
    name: str


class ChatCompletionNamedToolChoiceParam(_Model):
    """``{"type": "function", "function": {"name": ...}}``: the model must call this function."""

    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` request object (exactly one constraint; see docs/structured_outputs.md).

    Unknown keys are refused (a misspelt constraint must not be served unconstrained).
    """

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None


# ---------------------------------------------------------------------------------------------- responses


class FunctionCall(_Model):
    name: str
    arguments: str


class ToolCall(_Model):
    """One call in ``message.tool_calls``; ``arguments`` is JSON text."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Model):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="plain")
    def _drop_none(self) -> dict[str, Any]:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}


class DeltaToolCall(_Model):
    """A streamed piece of a call: the first piece of a call has ``id``, ``type`` and ``function.name``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="plain")
    def _drop_none(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
        if self.type is not None:
            out["type"] = self.type
        if self.function is not None:
            out["function"] = self.function.model_dump()
        return out
