"""The per-step context attention layers read (metadata of the flattened batch), set by the model runner.

Model code never passes paging information around: ``tokenmill.layers.Attention`` reads it from here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    """Attributes:
    attn_metadata: the attention backend's metadata for this step (``None`` for a dummy run without cache).
    attn_layers: the running model's attention layers by ``Attention.op_key``, where the
        ``tokenmill::attention`` custom op finds its layer (set with ``opaque_attention``).
    opaque_attention: attention layers call the ``tokenmill::attention`` custom op, which torch.compile
        keeps as one opaque call (the backend's Python runs inside it), instead of the backend directly.
    state_metadata: the state slots of the step's requests for the state layers of a hybrid model
        (``tokenmill.layers.mamba.StateMetadata``; ``None`` for models without state layers and dummy runs).
    """

    attn_metadata: Any
    opaque_attention: bool = False
    attn_layers: Any = None
    state_metadata: Any = None


_CONTEXT: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: Any, opaque_attention: bool = False, attn_layers: Any = None,
                        state_metadata: Any = None) -> Iterator[None]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, ForwardContext(attn_metadata, opaque_attention, attn_layers, state_metadata)
    try:
        yield
    finally:
        _CONTEXT = previous


def get_forward_context() -> ForwardContext:
    """Raises:
    RuntimeError: called outside a model runner step.
    """
    if _CONTEXT is None:
        raise RuntimeError("no forward context: attention layers run only inside a model runner step")
    return _CONTEXT
