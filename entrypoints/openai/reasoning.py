"""Reasoning models on the OpenAI server: the ``--reasoning-parser``, a request's thinking switch
(``reasoning_effort``, ``chat_template_kwargs``), its thinking budget and the split of each output into
``reasoning`` and ``content`` (see docs/reasoning.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.reasoning import ReasoningParser, ReasoningParserManager, ReasoningStream
from tokenmill.sampling_params import ReasoningParams

# OpenAI's values of ``reasoning_effort`` (``none`` and ``minimal`` are the newer ones).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
# Efforts that turn a template's on/off thinking switch off.
_NO_THINKING_EFFORTS = ("none", "minimal")
# Chat-template variables that switch thinking on and off: Qwen3's, then Granite's.
THINKING_SWITCHES = ("enable_thinking", "thinking")


def resolve_reasoning_parser(args: Any) -> type[ReasoningParser] | None:
    """The ``--reasoning-parser`` class (``None`` without the flag).

    Raises:
        UnknownReasoningParserError: an unknown name (the message lists the registered ones).
    """
    name = getattr(args, "reasoning_parser", None)
    return ReasoningParserManager.get_reasoning_parser(name) if name else None


def apply_reasoning_effort(effort: str | None, template_kwargs: dict[str, Any] | None,
                           template_variables: frozenset[str], param: str = "reasoning_effort"
                           ) -> dict[str, Any] | None:
    """``template_kwargs`` with ``reasoning_effort`` mapped onto the chat template's switch.

    A template that reads ``reasoning_effort`` gets it as it is; one with an on/off switch
    (``enable_thinking``, ``thinking``) gets ``false`` for ``none`` / ``minimal`` and ``true`` otherwise. A
    value the request set itself in ``chat_template_kwargs`` wins.

    Raises:
        InvalidRequestError: ``param`` (the request's field): an unknown effort, or a template with no switch.
    """
    if effort is None:
        return template_kwargs
    if effort not in REASONING_EFFORTS:
        raise InvalidRequestError(f"{param}: must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                                  param=param)
    kwargs = dict(template_kwargs or {})
    if "reasoning_effort" in template_variables:
        kwargs.setdefault("reasoning_effort", effort)
        return kwargs
    switch = next((s for s in THINKING_SWITCHES if s in template_variables), None)
    if switch is None:
        raise InvalidRequestError(
            f"{param}: this model's chat template has no reasoning switch (it reads none of "
            f"reasoning_effort, {', '.join(THINKING_SWITCHES)}), so the effort cannot be applied",
            param=param,
        )
    kwargs.setdefault(switch, effort not in _NO_THINKING_EFFORTS)
    return kwargs


@dataclass
class Reasoning:
    """One request's reasoning handling.

    Attributes:
        parser_cls: the server's ``--reasoning-parser`` class.
        tokenizer: the served model's tokenizer.
        chat_template_kwargs: the kwargs the prompt was rendered with (the thinking switch).
        include_reasoning: send the thinking (``false``: dropped from the response).
        thinking_token_budget: most thinking tokens (``None``: unlimited).
    """

    parser_cls: type[ReasoningParser]
    tokenizer: Any
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    thinking_token_budget: int | None = None
    _probe: ReasoningParser | None = field(default=None, repr=False)

    def new_parser(self) -> ReasoningParser:
        return self.parser_cls(self.tokenizer, self.chat_template_kwargs)

    @property
    def parser(self) -> ReasoningParser:
        """A parser for the request's settings (shared by the non-streaming splits)."""
        if self._probe is None:
            self._probe = self.new_parser()
        return self._probe

    def sampling_changes(self) -> dict[str, Any]:
        """``SamplingParams`` fields to set: the engine's :class:`ReasoningParams` (when the output thinks and
        the parser names an end marker) and the parser's ``skip_special_tokens``."""
        parser = self.parser
        changes: dict[str, Any] = {}
        end_ids = parser.reasoning_end_token_ids if parser.thinking_enabled else []
        if end_ids:
            changes["reasoning"] = ReasoningParams(end_token_ids=list(end_ids),
                                                   thinking_token_budget=self.thinking_token_budget)
        if parser.skip_special_tokens is not None:
            changes["skip_special_tokens"] = parser.skip_special_tokens
        return changes

    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning, content)`` of a finished output (reasoning ``None`` when absent or not included)."""
        reasoning, content = self.parser.extract_reasoning(text)
        return (reasoning if self.include_reasoning else None), content or ""

    def stream(self) -> ReasoningStream:
        """A stream for one choice."""
        return ReasoningStream(self.new_parser())
