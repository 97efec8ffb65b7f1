"""What the front end and the engine-core process agree on: the output frame markers, the READY handshake, and
which EngineCore class the process builds.

Both sides import this module (:mod:`tokenmill.engine.core_client` starts and reads the process,
:mod:`tokenmill.engine.core_proc` runs in it), so neither imports the other for it. The socket layout is
described in :mod:`tokenmill.engine.core_client`.
"""

from __future__ import annotations

import msgspec

# First frame of each message on the outputs socket (and of the handshake on the requests socket).
READY_FRAME = b"READY"
OUTPUTS_FRAME = b"\x00"
DEAD_FRAME = b"\x01"

DEFAULT_ENGINE_CORE_CLS = "tokenmill.engine.core:EngineCore"


class ReadyMessage(msgspec.Struct, omit_defaults=True):
    """The engine core's handshake: resolved facts, or why startup failed.

    Attributes:
        num_gpu_blocks: KV-cache blocks the engine core allocated.
        max_model_len: the context length in force.
        error: startup error (``"ExcType: message"``); the other fields are then meaningless.
    """

    num_gpu_blocks: int | None = None
    max_model_len: int = 0
    error: str | None = None


def resolve_engine_core_cls(spec: str | type | None) -> type:
    """The EngineCore class: ``None`` is the default, a string is a ``"module:Class"`` path.

    Raises:
        ImportError / ValueError: the path cannot be imported.
    """
    if spec is None:
        spec = DEFAULT_ENGINE_CORE_CLS
    if isinstance(spec, str):
        from tokenmill.plugins.qualname import resolve_qualname

        return resolve_qualname(spec)
    return spec
