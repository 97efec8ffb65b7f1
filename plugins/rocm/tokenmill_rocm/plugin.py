"""Platform hook of tokenmill-rocm: active on a ROCm (HIP) build of torch that sees an AMD GPU."""

from __future__ import annotations

from tokenmill.plugin_api import PlatformSpec, hookimpl

TOKENMILL_PLUGIN_API = ">=1.6,<2"  # 1.6: the Triton quantized-weight formats


def detect() -> tuple[bool, str]:
    """Active when torch is a HIP build and at least one GPU is visible.

    torch's ``device_count`` asks amdsmi first (no HIP context, fork-safe) and honours
    ``HIP_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES``.
    """
    import torch

    if torch.version.hip is None:
        return False, f"torch {torch.__version__} is not a ROCm/HIP build (torch.version.hip is None)"
    count = torch.cuda.device_count()
    if count <= 0:
        return False, f"torch (HIP {torch.version.hip}) sees no AMD GPU (check the driver and HIP_VISIBLE_DEVICES)"
    return True, f"{count} AMD GPU(s) visible, HIP {torch.version.hip}"


# Written out like tokenmill_cuda's and tokenmill_cpu's hooks on purpose: platform plugins ship as separate
# distributions and import only tokenmill.plugin_api, never each other.
@hookimpl
def tokenmill_platform() -> PlatformSpec:
    return PlatformSpec(
        name="rocm",
        detect=detect,
        platform_cls="tokenmill_rocm.platform:RocmPlatform",
        description="AMD GPUs (ROCm/HIP)",
    )
