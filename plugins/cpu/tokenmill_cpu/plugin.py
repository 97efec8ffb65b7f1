"""Platform hook of tokenmill-cpu: active when torch sees no accelerator."""

from __future__ import annotations

import os

from tokenmill.plugin_api import PlatformSpec, hookimpl

# 1.1: UnquantizedLinearMethod, Platform.allocate_kv_cache; 1.2: finish_kv_cache_allocation; 1.4: the state-layer
# ops (CausalConv1d, MambaSSD, GatedDeltaRule); 1.5: quantized KV caches (is_quantized_kv_dtype)
TOKENMILL_PLUGIN_API = ">=1.7,<2"  # 1.7: apply_with_bias and forward_bidirectional, which it overrides


def detect() -> tuple[bool, str]:
    """Active when torch has no usable accelerator. Never initialises a device.

    On CUDA builds the device count comes from NVML (``PYTORCH_NVML_BASED_CUDA_CHECK=1``), so no CUDA
    context is created and forking workers stays safe.
    """
    import torch

    accelerator = torch.accelerator.current_accelerator()  # compile-time only: no device touched
    if accelerator is None:
        return True, "torch was built without accelerator support"
    if accelerator.type == "cuda":
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        count = torch.cuda.device_count()
    else:
        count = 1 if torch.accelerator.is_available() else 0
    if count == 0:
        return True, f"torch supports {accelerator.type} but sees no {accelerator.type} device"
    return False, (
        f"torch sees a {accelerator.type} accelerator, which another platform plugin serves; "
        "use --platform cpu to run on the CPU anyway"
    )


@hookimpl
def tokenmill_platform() -> PlatformSpec:
    return PlatformSpec(
        name="cpu",
        detect=detect,
        platform_cls="tokenmill_cpu.platform:CpuPlatform",
        description="x86/ARM CPUs (torch on the host)",
    )


@hookimpl
def tokenmill_register_attention_backends(registry):  # noqa: ANN001, ANN201 - pluggy hook
    registry.register_backend("CPU_PAGED", "tokenmill_cpu.attention:CpuPagedAttentionBackend")
