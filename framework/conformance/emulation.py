"""Running a platform plugin's contract without its device: an emulated device on the host CPU.

:func:`emulated_platform` derives a subclass of the plugin's own Platform class that keeps everything the
plugin decides (dtypes, the attention backend, KV-sizing attributes, custom ops, quantization and MoE classes,
the config checks) and replaces only the device facts: tensors live on the CPU, the device has 16 GiB of which
12 GiB are free, there is one device, synchronisation is a no-op, and a platform that claims device graphs gets
the CPU capture emulator (:class:`tokenmill.worker.graph_emulator.EmulatedGraphCapture`) instead of its own
capture class. Triton kernels run in Triton's interpreter (:func:`prepare_emulation` sets
``TRITON_INTERPRET=1`` before triton is first imported).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tokenmill.platforms.interface import Platform

GiB = 1 << 30
EMULATED_TOTAL_MEMORY = 16 * GiB
EMULATED_AVAILABLE_MEMORY = 12 * GiB
EMULATOR_PATH = "tokenmill.worker.graph_emulator:EmulatedGraphCapture"


def prepare_emulation() -> None:
    """Make Triton kernels runnable on CPU tensors: ``TRITON_INTERPRET=1`` unless triton is already imported
    (then it must have been imported with it)."""
    if "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def emulated_platform(cls: type[Platform]) -> type[Platform]:
    """A subclass of ``cls`` whose device is emulated on the host CPU (see the module docstring)."""
    claims_graphs = bool(cls.supports_graph_capture and cls.graph_capture_cls())

    def device_name(c: Any, device_id: int = 0) -> str:
        return f"emulated {cls.name} device (host CPU)"

    attrs: dict[str, Any] = {
        "__module__": __name__,
        "__doc__": f"{cls.__qualname__} on an emulated device (tokenmill.conformance.emulation).",
        "device_type": "cpu",
        "dist_backend": "gloo",
        "supports_compile": False,
        "ranks_share_device": True,
        "emulates": cls,
        "get_device_name": classmethod(device_name),
        "get_device_total_memory": classmethod(lambda c, device_id=0: EMULATED_TOTAL_MEMORY),
        "get_device_available_memory": classmethod(lambda c, device_id=0: EMULATED_AVAILABLE_MEMORY),
        "device_count": classmethod(lambda c: 1),
        "current_device_id": classmethod(lambda c: 0),
        "set_device": classmethod(lambda c, device: None),
        "synchronize": classmethod(lambda c: None),
        "empty_cache": classmethod(lambda c: None),
        "supports_memory_profiling": classmethod(lambda c: False),
        "make_device": classmethod(lambda c, local_rank: __import__("torch").device("cpu")),
        "graph_capture_cls": classmethod(lambda c: EMULATOR_PATH if claims_graphs else None),
    }
    return type(f"Emulated{cls.__name__}", (cls,), attrs)
