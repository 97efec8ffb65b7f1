"""Platform hook of tokenmill-cuda: active on a CUDA build of torch that sees an NVIDIA GPU."""

from __future__ import annotations

import os

from tokenmill.plugin_api import PlatformSpec, hookimpl

TOKENMILL_PLUGIN_API = ">=1.6,<2"  # 1.6: the Triton quantized-weight formats


def detect() -> tuple[bool, str]:
    """Active when torch is a CUDA (not HIP) build and at least one GPU is visible.

    The count comes from NVML (torch's ``device_count`` asks NVML first and honours
    ``CUDA_VISIBLE_DEVICES``; ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` keeps ``is_available`` NVML-based too), so
    no CUDA context is created before workers fork.
    """
    import torch

    if torch.version.hip is not None:
        return False, f"torch is a ROCm/HIP build ({torch.version.hip}); install tokenmill-rocm instead"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is built without CUDA (torch.version.cuda is None)"
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    count = torch.cuda.device_count()
    if count <= 0:
        return False, (
            f"torch (CUDA {torch.version.cuda}) sees no NVIDIA GPU (check the driver and CUDA_VISIBLE_DEVICES)"
        )
    return True, f"{count} NVIDIA GPU(s) visible, CUDA {torch.version.cuda}"


# Written out like tokenmill_cpu's and tokenmill_rocm's hooks: platform plugins ship as separate distributions
# and import only tokenmill.plugin_api, never each other.
@hookimpl
def tokenmill_platform() -> PlatformSpec:
    return PlatformSpec(
        name="cuda",
        detect=detect,
        platform_cls="tokenmill_cuda.platform:CudaPlatform",
        description="NVIDIA GPUs (CUDA)",
    )
