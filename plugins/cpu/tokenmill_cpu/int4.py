"""Weight-only int4 for CPU: torch's packed int4 matmul (``aten._weight_int4pack_mm_for_cpu``).

Each row of ``W [N, K]`` is cut into groups of :data:`GROUP_SIZE` input channels; a group with minimum ``m``
and maximum ``M`` stores ``q = round((w - m) / d)`` in ``0..15`` with ``d = (M - m) / 15``, so
``w ~ d * q + m``: the layout of GGUF's ``Q4_1`` (32-weight blocks with a scale and a minimum), which makes
a Q4_1 checkpoint's dequantized weights quantize back to the same codes. The kernel computes
``(q - 8) * scale + zero`` per group, so it is given ``scale = d`` and ``zero = m + 8 d``, both bfloat16,
as ``scales_and_zeros [K / GROUP_SIZE, N, 2]``; activations are multiplied in bfloat16.
"""

from __future__ import annotations

import torch

from tokenmill.plugin_api import QuantizedWeight, UnsupportedShapeError

GROUP_SIZE = 32
INNER_K_TILES = 2  # packing parameter of _convert_weight_to_int4pack_for_cpu (2, 4 or 8)


class Int4WeightOnly(QuantizedWeight):
    """Int4 copy of a weight ``[N, K]`` (``K`` a multiple of 32, ``N`` of 16: the kernel's tiling).

    Attributes:
        packed: torch's packed int4 weight (opaque layout, ``N * K / 2`` bytes).
        scales_and_zeros: ``[K / 32, N, 2]`` bfloat16.

    Raises:
        UnsupportedShapeError: ``K`` is not a multiple of 32 or ``N`` of 16.
    """

    # Output heads (often tied to the embedding) are commonly stored at 8 bits (GGUF Q8_0) and their errors
    # move every logit: SmolLM2's Q8_0 head re-quantized to 4 bits is 9% off (relative Frobenius error), its
    # Q4_1 layers 0.25%, and greedy answers then diverged from float32 after 7 tokens instead of 36.
    lm_head_method = "int8"

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        n, k = weight.shape
        if k % GROUP_SIZE or n % 16:
            raise UnsupportedShapeError(
                f"int4 needs input features divisible by {GROUP_SIZE} and output features by 16, got [{n}, {k}]"
            )
        groups = weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        low = groups.amin(dim=-1, keepdim=True)
        scale = ((groups.amax(dim=-1, keepdim=True) - low) / 15.0).clamp(min=1e-12)
        codes = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32).reshape(n, k)
        zero = low + 8.0 * scale
        self.store(
            packed=torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), INNER_K_TILES),
            scales_and_zeros=torch.cat((scale, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16),
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return y.reshape(*lead, -1).to(x.dtype)
