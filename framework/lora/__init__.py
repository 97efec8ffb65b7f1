"""Multi-LoRA serving: PEFT adapters applied per request, many adapters batched in one forward pass.

See docs/lora.md. :class:`LoRARequest` is the public name; the rest is used by the engine:
``tokenmill.lora.peft`` (reading and checking adapters), ``tokenmill.lora.layers`` (linear layers with LoRA
slots), ``tokenmill.lora.ops`` (the batched shrink/expand and its platform hook), ``tokenmill.lora.manager``
(CPU cache and GPU slots, LRU).
"""

from __future__ import annotations

from tokenmill.lora.request import LoRALoadError, LoRARequest

__all__ = ["LoRARequest", "LoRALoadError"]
