"""Quantized copies of linear layers and the LM head (``--quantization int8|int4``).

A layer keeps its full-precision weight and gains a quantized copy (:class:`QuantizedWeight`) that it uses for
inputs of at most ``max_tokens`` rows: small steps (decode with few running requests) are bound by reading the
weights, so fewer weight bytes make them faster, while large steps are compute-bound and run on the
full-precision weight. Which classes implement a method comes from the platform
(``Platform.get_quant_method_cls``), since the packed-weight kernels are device-specific:

* ``int8`` (the default for every platform whose torch has ``aten._weight_int8pack_mm``):
  :class:`Int8WeightOnly`, symmetric per-output-channel scales, ``q[n] = round(W[n] / s[n])``,
  ``s[n] = max|W[n]| / 127``.
* The CPU plugin replaces both: ``int8`` and ``int4`` in GGUF's ``Q8_0`` / ``Q4_1`` blocks of 32 input channels,
  multiplied with 14-bit integer activations by its VNNI kernels (``tokenmill_cpu.quant_linear``); under ``int4`` the LM
  head stays 8-bit (``QuantizedWeight.lm_head_method``).
* The CUDA and ROCm plugins name the Triton group-quantized formats (``tokenmill.layers.triton_quant_linear``).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from tokenmill.config import QUANTIZATION_METHODS

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 32


class QuantizedWeight(nn.Module, ABC):
    """A quantized copy of one weight ``W [N, K]``: a submodule of the layer (``layer.quant``) whose tensors are
    non-persistent buffers (:meth:`store`). As plain attributes of a plain object they made torch.compile trace
    and guard each tensor separately: with ``--quantization int4`` and a warm compile cache the engine core was
    ready in 87 s instead of 60 (the "engine core ready" log line of ``tokenmill bench latency``).

    Attributes:
        lm_head_method: the method the LM head uses when this one is chosen (``None``: this one).

    Raises (constructor):
        UnsupportedShapeError: the method cannot pack this shape (the layer then stays full precision).
    """

    lm_head_method: ClassVar[str | None] = None

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape

    def store(self, **tensors: torch.Tensor) -> None:
        """Keep ``tensors`` as non-persistent buffers: they follow the module (``.to()``) and torch.compile
        lifts them as graph inputs of the layer that owns this copy."""
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor, persistent=False)

    @classmethod
    def from_gguf(cls, type_name: str, blocks: torch.Tensor) -> QuantizedWeight | None:
        """This format holding GGUF blocks (the same codes, no float copy; the same scales, or scales rounded to
        the format's precision where its docstring says so), or ``None`` when it cannot (the default): the
        loader then dequantizes and calls the constructor.

        Args:
            type_name: the GGML type (``"Q4_0"``, ``"Q8_0"``, ...).
            blocks: ``[N, bytes_per_row]`` uint8, row ``n`` the blocks of output row ``n`` (GGML's layouts:
                ``tokenmill.model_loader.gguf_dequant``).

        Raises:
            UnsupportedShapeError: the format maps the type but cannot pack this shape.
        """
        return None

    @classmethod
    def from_zero_point(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
                        ) -> QuantizedWeight | None:
        """This format holding group-quantized rows ``w[n, k] = scales[n, k // g] * (codes[n, k] - zeros[n, k // g])``
        (``g = K / G``; AWQ, GPTQ and compressed-tensors checkpoints, ``tokenmill.model_loader.hf_quant_weights``)
        exactly, or ``None`` when it cannot (the default: the loader then keeps the layer in float).

        Args:
            codes: ``[N, K]`` uint8 in ``0 .. 2**bits - 1``.
            scales: ``[N, G]`` float (the checkpoint's dtype, usually float16).
            zeros: ``[N, G]`` int16.
            bits: bits per code.

        Raises:
            UnsupportedShapeError: the format could hold these values but not this shape.
        """
        return None

    @classmethod
    def concat_rows(cls, parts: list[QuantizedWeight]) -> QuantizedWeight | None:
        """One weight whose output rows are ``parts``' rows in order (weights quantized a tile of rows at a time,
        so that no whole float copy of a large weight is made), or ``None`` when the format cannot join them
        (the default: the loader then quantizes the weight in one piece)."""
        return None

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` -> ``x @ W^T`` ``[..., N]`` in ``x``'s dtype."""

    @property
    def nbytes(self) -> int:
        """Bytes the quantized weight and its scales take (every tensor kept with :meth:`store`)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())


class PermutedInput(QuantizedWeight):
    """A quantized weight whose input channels are stored in another order: ``matmul(x) = inner.matmul(x[..., perm])``
    (GPTQ's activation order, ``desc_act``: sorting input channels by group makes each group consecutive, which
    the formats need; ``tokenmill.model_loader.quantized_loading``).

    Attributes:
        inner: the weight with input channel ``i`` holding the layer's channel ``perm[i]``.
        perm: ``[K]`` int64, a permutation.
    """

    def __init__(self, inner: QuantizedWeight, perm: torch.Tensor) -> None:
        super().__init__(torch.empty(inner.out_features, inner.in_features, device="meta"))
        self.inner = inner
        self.store(perm=perm.to(torch.int64).contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]`` in ``x``'s dtype."""
        return self.inner.matmul(x.index_select(-1, self.perm))

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` float32 in the layer's channel order (tests and error reports)."""
        w = self.inner.dequantize()  # type: ignore[operator]
        return torch.empty_like(w).index_copy_(1, self.perm, w)


class WeightRowSink(Protocol):
    """Where a layer hands its weight's rows while weights are loaded quantized
    (``tokenmill.model_loader.quantized_loading``)."""

    def add_rows(self, offset: int, rows: Any) -> None:
        """Rows ``offset:offset + len(rows)`` of the weight: a float tensor or GGUF blocks (``[rows, K]``)."""


class UnsupportedShapeError(ValueError):
    """A quantization method cannot pack a weight of this shape."""


class Int8WeightOnly(QuantizedWeight):
    """Per-channel symmetric int8, multiplied by ``aten._weight_int8pack_mm`` with bfloat16 activations.

    Attributes:
        qweight: ``[N, K]`` int8.
        scales: ``[N]`` bfloat16 per-channel scales.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.store(qweight=torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous(),
                   scales=scales.to(torch.bfloat16))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        return y.reshape(*lead, -1).to(x.dtype)


def get_quantized_weight_cls(method: str) -> type[QuantizedWeight]:
    """The class implementing ``method``: a ``quant_linear.<method>`` custom op registered by the script or a
    plugin (see :mod:`tokenmill.layers.custom_op`), else the current platform's ``get_quant_method_cls``.

    Raises:
        ValueError: unknown method, or the platform does not support it (the message names ``quantization``).
        TypeError: the class found is not a :class:`QuantizedWeight`.
    """
    from tokenmill.layers.custom_op import CustomOpRegistry
    from tokenmill.platforms import get_current_platform
    from tokenmill.plugins import resolve_qualname

    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: unknown method {method!r} (choose from {', '.join(QUANTIZATION_METHODS)})")
    op = f"quant_linear.{method}"
    target = CustomOpRegistry.lookup(op)
    if target is None:
        platform = get_current_platform()
        target = platform.get_quant_method_cls(method)
        if target is None:
            raise ValueError(f"quantization: {method!r} is not supported on the {platform.name} platform")
    cls = resolve_qualname(target) if isinstance(target, str) else target
    if not (isinstance(cls, type) and issubclass(cls, QuantizedWeight)):
        raise TypeError(f"quantization: {target!r} (for {method!r}) is not a QuantizedWeight subclass")
    return cls


def quantize_model(model: nn.Module, method: str, max_tokens: int = DEFAULT_MAX_TOKENS) -> int:
    """Attach quantized copies to every module with ``attach_quantized`` (linear layers, LM head) unless it sets
    ``quantizable = False`` (mixture-of-experts routers). Expert weights (``FusedMoE``) stay full precision.

    Returns:
        the number of modules quantized (a module whose shape the method cannot pack is skipped).

    Raises:
        ValueError: see :func:`get_quantized_weight_cls`.
    """
    cls = get_quantized_weight_cls(method)
    head_cls = get_quantized_weight_cls(cls.lm_head_method) if cls.lm_head_method else cls
    count = skipped = nbytes = 0
    for module in model.modules():
        attach = getattr(module, "attach_quantized", None)
        if attach is None or not getattr(module, "quantizable", True):  # e.g. MoE routers: choices stay exact
            continue
        if getattr(module, "quant_only", False):  # loaded quantized (tokenmill.model_loader.quantized_loading)
            count += 1
            nbytes += module.quant.nbytes
            continue
        try:
            attach(head_cls if getattr(module, "is_lm_head", False) else cls, max_tokens)
        except UnsupportedShapeError:
            skipped += 1
            continue
        count += 1
        quant = getattr(module, "quant", None)  # where the layers of tokenmill.layers keep it
        nbytes += quant.nbytes if quant is not None else 0
    logger.info("quantization %s: %d modules quantized (%s, LM head %s; %.1f MiB more), %d left full precision; "
                "used for steps of at most %d tokens", method, count, cls.__qualname__, head_cls.__qualname__,
                nbytes / 2**20, skipped, max_tokens)
    return count
