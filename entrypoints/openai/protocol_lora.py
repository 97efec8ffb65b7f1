"""Request bodies of the LoRA adapter routes (vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``)."""

from __future__ import annotations

from tokenmill.entrypoints.openai.protocol import RequestModel


class LoadLoRAAdapterRequest(RequestModel):
    """``POST /v1/load_lora_adapter``: ``lora_path`` is a PEFT adapter directory on the server's disk."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    """``POST /v1/unload_lora_adapter`` (vLLM also accepts ``lora_int_id``; it is ignored here: names identify
    adapters)."""

    lora_name: str
    lora_int_id: int | None = None
