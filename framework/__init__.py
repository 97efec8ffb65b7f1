"""tokenmill: a fast, memory-efficient LLM inference and serving engine with a plugin core.

Public API: :class:`LLM`, :class:`SamplingParams`, :class:`StructuredOutputsParams`, :class:`RequestOutput`,
:class:`CompletionOutput`, :class:`ModelRegistry`, :class:`EngineArgs`, :class:`LoRARequest`, ``__version__``. Heavy
modules are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.version import __version__

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "ModelRegistry",
    "EngineArgs",
    "LoRARequest",
    "__version__",
]

_LAZY = {
    "LLM": "tokenmill.entrypoints.llm",
    "SamplingParams": "tokenmill.sampling_params",
    "StructuredOutputsParams": "tokenmill.sampling_params",
    "RequestOutput": "tokenmill.outputs",
    "CompletionOutput": "tokenmill.outputs",
    "ModelRegistry": "tokenmill.model_loader.registry",
    "EngineArgs": "tokenmill.engine_args",
    "LoRARequest": "tokenmill.lora.request",
}

if TYPE_CHECKING:
    from tokenmill.engine_args import EngineArgs
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.lora.request import LoRARequest
    from tokenmill.model_loader.registry import ModelRegistry
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
