"""Weight-only int8 quantization for linear layers (``--quantization int8``).

Each output channel ``n`` of a weight ``W [N, K]`` is stored as ``q[n] = round(W[n] / s[n])`` in int8 with
``s[n] = max|W[n]| / 127`` (symmetric absmax, per channel). Activations stay in bfloat16 and the product runs
in torch's ``aten._weight_int8pack_mm`` kernel, which reads a quarter of float32's weight bytes: a win where a
step is bound by reading the weights (decode with few running requests). Large batches are compute-bound, so the
layer keeps its full-precision weight and uses it when a step has more than ``max_tokens`` rows.
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATION_METHODS = ("int8",)


class Int8WeightOnly:
    """An int8 copy of one weight.

    Args:
        weight: ``[N, K]`` float weight.

    Attributes:
        qweight: ``[N, K]`` int8.
        scales: ``[N]`` bfloat16 per-channel scales.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.qweight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(torch.bfloat16)
        self.in_features = weight.shape[1]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` -> ``x @ W^T`` ``[..., N]`` in ``x``'s dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        return y.reshape(*lead, -1).to(x.dtype)


def quantize_model(model: nn.Module, method: str, max_tokens: int = 32) -> int:
    """Attach quantized copies to every linear layer and LM head that supports it.

    Returns:
        the number of layers quantized.

    Raises:
        ValueError: unknown method.
    """
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: unknown method {method!r} (choose from {', '.join(QUANTIZATION_METHODS)})")
    count = 0
    for module in model.modules():
        attach = getattr(module, "attach_int8", None)
        if attach is not None:
            attach(max_tokens)
            count += 1
    return count
