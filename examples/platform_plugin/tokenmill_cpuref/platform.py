"""CpuRefPlatform: what differs from tokenmill's Platform base, and nothing else.

* the portable ``TORCH_PAGED`` attention backend;
* its own KV-cache sizing, stated as facts for the base class's formula: host memory is shared with the OS, so
  the cache takes a tenth of the memory available once the weights are loaded, at most 1 GiB;
* its own device facts (read from ``/proc/meminfo`` and ``os.sysconf``, without psutil);
* one custom op: RMSNorm through ``torch.nn.functional.rms_norm`` (``tokenmill_cpuref.ops``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, ClassVar

from tokenmill.plugin_api import Platform

if TYPE_CHECKING:
    import torch

    from tokenmill.plugin_api import EngineConfig


class CpuRefPlatform(Platform):
    name: ClassVar[str] = "cpuref"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    default_dtype: ClassVar[str] = "float32"
    memory_accounting: ClassVar[str] = "available"
    kv_cache_available_fraction: ClassVar[float] = 0.1
    kv_cache_cap_bytes: ClassVar[int | None] = 1 << 30

    @classmethod
    def get_attn_backend_cls(cls, config: EngineConfig) -> str:
        return "TORCH_PAGED"

    @classmethod
    def get_custom_op_cls(cls, name: str) -> str | None:
        return {"rms_norm": "tokenmill_cpuref.ops:FunctionalRMSNorm"}.get(name)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"cpu-reference device ({os.cpu_count()} host cores)"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    @classmethod
    def get_device_available_memory(cls, device_id: int = 0) -> int:
        """The kernel's estimate of memory available without swapping (``MemAvailable``: free memory plus
        reclaimable page cache); free pages only where ``/proc/meminfo`` is missing."""
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def supports_memory_profiling(cls) -> bool:
        return False

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"the cpuref platform cannot use device {device}")

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def make_device(cls, local_rank: int) -> torch.device:
        import torch

        return torch.device("cpu")
