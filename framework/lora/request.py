"""LoRARequest: which adapter a request runs with (vLLM's names and argument order)."""

from __future__ import annotations

import msgspec

from tokenmill.errors import InvalidRequestError


class LoRALoadError(InvalidRequestError):
    """An adapter cannot be used with this engine (missing or corrupt files, rank above ``max_lora_rank``,
    modules the model lacks, a PEFT feature that is not supported). HTTP 400 on the server; the message
    says why."""

    def __init__(self, message: str, param: str | None = "lora_path") -> None:
        super().__init__(message, param)


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """A LoRA adapter in PEFT format, named for requests.

    ``LoRARequest("sql", 1, "/adapters/sql")`` as in vLLM.

    Attributes:
        lora_name: the name requests use (the OpenAI ``model`` field on the server).
        lora_int_id: a positive id unique per adapter in one engine; it keys the adapter's GPU slot and its
            prefix-cache blocks (two ids never share KV blocks), so give a changed adapter a new id.
        lora_path: the directory holding ``adapter_config.json`` and ``adapter_model.safetensors``.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be at least 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name: must not be empty")
