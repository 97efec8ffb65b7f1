"""RMSNorm (Zhang & Sennrich 2019) with an optional fused residual add, computed in float32 like transformers.

Variants used by the built-in families:

* Llama, Qwen, Mistral, Phi-3, Granite, Mixtral: ``weight * norm(x).to(dtype)``.
* Gemma 2 / 3: ``(norm(x) * (1 + weight)).to(dtype)`` (``offset=1.0``, the weight stored as a delta from one,
  ``multiply_in_float32=True``), as in Google's reference code.
* OLMo 2: ``(weight * norm(x)).to(dtype)`` (``multiply_in_float32=True``), and its whole-projection q/k norm
  split over tensor-parallel ranks (:class:`ShardedRMSNorm`).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed import get_tp_size, tp_all_reduce
from tokenmill.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """``y = x / sqrt(mean(x^2) + eps) * (offset + weight)`` over the last dimension.

    Custom op ``rms_norm`` (a platform or plugin may replace it, see :mod:`tokenmill.layers.custom_op`): a
    replacement keeps the constructor, the ``weight`` parameter and the call forms of :meth:`forward_native`.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square.
        offset: added to the stored weight (1.0 for Gemma, whose checkpoints store ``weight - 1``).
        multiply_in_float32: multiply by the weight before casting back to the input dtype (Gemma, OLMo 2);
            otherwise the normalised value is cast first (Llama). Identical in float32.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, *, offset: float = 0.0, multiply_in_float32: bool = False
    ) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.multiply_in_float32 = multiply_in_float32
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self._scale(h, dtype)

    def _scale(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.multiply_in_float32:
            w = self.weight.float() + self.offset if self.offset else self.weight.float()
            return (h * w).to(dtype)
        w = self.weight + self.offset if self.offset else self.weight
        return w * h.to(dtype)

    op_name = "rms_norm"

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or with ``residual`` (the fused residual add of pre-norm decoder layers) the pair
        ``(norm(x + residual), x + residual)``. ``x``, ``residual``: ``[..., H]`` in the model dtype; the
        normalisation runs in float32 and the result has ``x``'s dtype."""
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)


class ShardedRMSNorm(RMSNorm):  # its own op: a replacement of rms_norm does not replace it
    """RMSNorm over a dimension split across tensor-parallel ranks (OLMo 2's norm of the whole query/key
    projection): each rank holds ``local_size`` columns and the mean square is summed over ranks.

    When ``num_shards`` is smaller than the tensor-parallel size (key heads replicated over ranks), ranks
    holding the same shard contribute equally, so ``all_reduce(sum x^2) / (local_size * tp_size)`` is still
    the mean over the full dimension.

    Args:
        local_size: columns on this rank.
        shard_rank: which slice of the checkpoint's weight this rank holds.
        eps, offset, multiply_in_float32: as :class:`RMSNorm`.
    """

    def __init__(
        self, local_size: int, shard_rank: int, eps: float = 1e-6, *, offset: float = 0.0,
        multiply_in_float32: bool = False,
    ) -> None:
        super().__init__(local_size, eps, offset=offset, multiply_in_float32=multiply_in_float32)
        self.shard_rank = shard_rank
        self.tp_size = get_tp_size()
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.shape[0]
        part = loaded.narrow(0, self.shard_rank * n, n)
        if part.shape != param.shape:
            raise ValueError(f"shape mismatch: norm {tuple(param.shape)} vs checkpoint slice {tuple(part.shape)}")
        param.data.copy_(part)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super()._norm(x)
        dtype = x.dtype
        h = x.float()
        total = tp_all_reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(total / (h.shape[-1] * self.tp_size) + self.eps)
        return self._scale(h, dtype)
