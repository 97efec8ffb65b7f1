"""Chat messages -> prompt text, with the tokenizer's chat template or the one given by ``--chat-template``."""

from __future__ import annotations

import inspect
import os
from typing import Any

import jinja2
from tokenmill.errors import InvalidRequestError

# What a failing template raises (``raise_exception`` in templates raises jinja2.TemplateError).
_TEMPLATE_ERRORS = (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError)


def load_chat_template(value: str | None) -> str | None:
    """The ``--chat-template`` argument as template text: a file's contents, or the value itself when it is
    an inline Jinja template.

    Raises:
        FileNotFoundError: ``value`` is neither an existing file nor a template.
    """
    if value is None:
        return None
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise FileNotFoundError(f"chat_template: {value!r} is neither a file nor a Jinja template")


def _reserved_template_kwargs(tokenizer: Any) -> frozenset[str]:
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters
    except (TypeError, ValueError, AttributeError):
        return frozenset({"conversation", "tokenize", "chat_template"})
    return frozenset(name for name, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD)


class ChatRenderer:
    """Renders chat messages to prompt text (call it from the tokenizer thread).

    Args:
        tokenizer: a ``transformers`` tokenizer (its ``apply_chat_template`` renders).
        chat_template: template text replacing the tokenizer's own (``None``: the tokenizer's).
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._reserved = _reserved_template_kwargs(tokenizer)
        self._variables: frozenset[str] | None = None

    @property
    def template_variables(self) -> frozenset[str]:
        """The variables the active template reads (e.g. ``enable_thinking``); empty without a template."""
        if self._variables is None:
            from jinja2 import meta
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            source = self.chat_template or getattr(self.tokenizer, "chat_template", None)
            if isinstance(source, dict):  # transformers allows named templates: the default one renders
                source = source.get("default")
            try:
                ast = ImmutableSandboxedEnvironment().parse(source) if isinstance(source, str) else None
            except jinja2.TemplateSyntaxError:
                ast = None
            self._variables = frozenset(meta.find_undeclared_variables(ast)) if ast is not None else frozenset()
        return self._variables

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, continue_final_message: bool,
               template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of ``messages``; ``tools`` (OpenAI tool objects) go to the template's own tool
        rendering (``tools`` variable, as transformers passes it).

        Raises:
            InvalidRequestError: reserved keys in ``template_kwargs`` (``param="chat_template_kwargs"``), or
                the template failed on these messages (``param="messages"``, with the template's message).
        """
        extra = dict(template_kwargs or {})
        clash = sorted(set(extra) & self._reserved)
        if clash:
            raise InvalidRequestError(f"chat_template_kwargs: reserved keys {clash}", param="chat_template_kwargs")
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "messages: the model has no chat template; start the server with --chat-template FILE",
                param="messages",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=self.chat_template,
                tools=tools,
                **extra,
            )
        except _TEMPLATE_ERRORS as exc:
            raise InvalidRequestError(
                f"messages: the chat template could not be applied: {exc}", param="messages"
            ) from exc
        if not isinstance(text, str):
            raise InvalidRequestError("messages: the chat template did not produce text", param="messages")
        return text
