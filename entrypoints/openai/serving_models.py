"""The models this server serves: ``GET /v1/models``, the ``model`` field of every request, and LoRA adapters
(``--lora-modules``, ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``; see docs/lora.md)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.entrypoints.openai.errors import ModelNotFoundError
from tokenmill.entrypoints.openai.responses import ModelCard, ModelList
from tokenmill.errors import InvalidRequestError
from tokenmill.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: ``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}``."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        """Raises ValueError (naming ``lora_modules``) for anything else."""
        text = text.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
                return cls(str(obj["name"]), str(obj["path"]), obj.get("base_model_name"))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"lora_modules: {text!r} is not a JSON object with name and path ({exc})") from None
        name, sep, path = text.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: expected name=path or a JSON object, got {text!r}")
        return cls(name.strip(), path.strip())


def parse_lora_modules(values: list[str] | None) -> list[LoRAModulePath]:
    """The ``--lora-modules`` values. Raises ValueError for a malformed one."""
    return [LoRAModulePath.parse(v) for v in values or []]


class OpenAIServingModels:
    """Knows the served model name(s) and LoRA adapters, and answers which one a request means.

    Args:
        served_model_names: names the API accepts; the first one is reported in responses.
        root: where the model was loaded from (reported as ``root`` in the model card).
        max_model_len: context length in tokens.
        lora_enabled: the engine runs with ``--enable-lora`` (else loading an adapter is a 400).
    """

    def __init__(self, served_model_names: list[str], root: str | None, max_model_len: int,
                 lora_enabled: bool = False) -> None:
        if not served_model_names:
            raise ValueError("served_model_names: at least one name is needed")
        self.served_model_names = list(served_model_names)
        self.root = root
        self.max_model_len = max_model_len
        self.created = int(time.time())
        self.lora_enabled = lora_enabled
        self.lora_requests: dict[str, LoRARequest] = {}
        # every load gets a new id, so a reloaded adapter never reuses the prefix-cache blocks of the old one
        self._lora_ids = itertools.count(1)
        self._lora_lock = asyncio.Lock()

    @property
    def default_name(self) -> str:
        return self.served_model_names[0]

    def known_names(self) -> list[str]:
        return [*self.served_model_names, *self.lora_requests]

    def resolve(self, requested: str | None) -> str:
        """The name to report for a request asking for ``requested`` (``None`` or ``""``: the default model).

        Raises:
            ModelNotFoundError: ``requested`` is neither served here nor a loaded adapter (the message lists
                the names that are).
        """
        if requested is None or requested == "":
            return self.default_name
        if requested in self.served_model_names or requested in self.lora_requests:
            return requested
        raise ModelNotFoundError(requested, self.known_names())

    def lora_request(self, model_name: str | None) -> LoRARequest | None:
        """The adapter a (resolved) model name means, ``None`` for the base model."""
        return self.lora_requests.get(model_name) if model_name else None

    def card(self, name: str) -> ModelCard:
        """Raises ModelNotFoundError for a name not served here."""
        resolved = self.resolve(name)
        lora = self.lora_requests.get(resolved)
        if lora is not None:
            return ModelCard(id=resolved, created=self.created, root=lora.lora_path, parent=self.default_name,
                             max_model_len=self.max_model_len)
        return ModelCard(id=resolved, created=self.created, root=self.root, max_model_len=self.max_model_len)

    def list_models(self) -> ModelList:
        return ModelList(data=[self.card(name) for name in self.known_names()])

    # ------------------------------------------------------------------ adapters

    async def load_lora_adapter(self, engine: Any, lora_name: Any, lora_path: Any) -> str:
        """Load an adapter under ``lora_name`` (vLLM's ``/v1/load_lora_adapter``); returns a success message.

        Raises:
            InvalidRequestError: LoRA is off, a field is missing, the name is taken, or the adapter cannot be
                used (``LoRALoadError``: the reason; nothing of it stays loaded).
        """
        if not self.lora_enabled:
            raise InvalidRequestError("LoRA adapters are not enabled on this server; start it with --enable-lora",
                                      param="lora_name")
        for param, value in (("lora_name", lora_name), ("lora_path", lora_path)):
            if not isinstance(value, str) or not value.strip():
                raise InvalidRequestError(f"{param}: a non-empty string is required", param=param)
        async with self._lora_lock:
            if lora_name in self.lora_requests or lora_name in self.served_model_names:
                raise InvalidRequestError(f"The lora adapter '{lora_name}' has already been loaded.", param="lora_name")
            request = LoRARequest(lora_name, next(self._lora_ids), lora_path)
            await engine.add_lora(request)
            self.lora_requests[lora_name] = request
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload_lora_adapter(self, engine: Any, lora_name: Any) -> str:
        """Unload an adapter (vLLM's ``/v1/unload_lora_adapter``); requests already running with it finish.

        Raises:
            InvalidRequestError: LoRA is off or ``lora_name`` is missing.
            ModelNotFoundError: no adapter of that name is loaded (404; the message lists the loaded ones).
        """
        if not self.lora_enabled:
            raise InvalidRequestError("LoRA adapters are not enabled on this server; start it with --enable-lora",
                                      param="lora_name")
        if not isinstance(lora_name, str) or not lora_name:
            raise InvalidRequestError("lora_name: a non-empty string is required", param="lora_name")
        async with self._lora_lock:
            request = self.lora_requests.pop(lora_name, None)
            if request is None:
                raise ModelNotFoundError(lora_name, list(self.lora_requests), what="lora adapter", param="lora_name")
            await engine.remove_lora(request.lora_int_id)
        return f"Success: LoRA adapter '{lora_name}' removed successfully."

    async def load_static_loras(self, engine: Any, modules: list[LoRAModulePath]) -> None:
        """Load the ``--lora-modules`` adapters at start-up.

        Raises:
            ValueError: LoRA is off, or an adapter cannot be loaded (the server should not start).
        """
        if modules and not self.lora_enabled:
            raise ValueError("lora_modules: needs --enable-lora")
        for module in modules:
            try:
                await self.load_lora_adapter(engine, module.name, module.path)
            except InvalidRequestError as exc:
                raise ValueError(f"lora_modules: cannot load {module.name}={module.path}: {exc}") from None
