"""compressed-tensors and FP8 linear weights of a Hugging Face checkpoint, as the weight loaders take them.

A quantized module ``p`` is stored as (``N`` output and ``K`` input features, ``G`` groups):

* compressed-tensors ``pack-quantized`` (int, 4 or 8 bits): ``p.weight_packed`` int32 ``[N, K * bits / 32]``,
  ``32 / bits`` codes of consecutive input channels per word, lowest bits first, each stored as
  ``q + 2**(bits-1)`` for a signed code ``q``; ``p.weight_shape`` ``[2]`` = ``(N, K)``; ``p.weight_scale``
  ``[N, G]`` (``[N, 1]`` channel-wise, one element per tensor); for asymmetric schemes ``p.weight_zero_point``,
  signed zero points stored like the codes and packed along the output rows (int32 ``[N * bits / 32, G]``;
  older files: int8 ``[N, G]`` unpacked); optionally ``p.weight_g_idx`` ``[K]`` (activation order).
  Value ``w = scale * (q - zero_point)``.
* compressed-tensors ``int-quantized`` / ``naive-quantized`` int8: ``p.weight`` int8 ``[N, K]`` (signed codes),
  ``p.weight_scale`` and optional ``p.weight_zero_point`` as above but unpacked.
* compressed-tensors ``float-quantized`` and ``quant_method: fp8``: ``p.weight`` float8 (E4M3) ``[N, K]`` and
  ``p.weight_scale`` (one per tensor, per row ``[N, 1]``, per group ``[N, G]``) or ``p.weight_scale_inv`` (FP8's
  block-wise scales ``[ceil(N / bn), ceil(K / bk)]`` for ``weight_block_size`` ``(bn, bk)``; despite the name the
  value is multiplied: ``w = weight * scale_inv``, as DeepSeek-V3 and transformers define it).

Integer weights become :class:`~tokenmill.model_loader.group_quant_tensor.GroupQuantTensor` rows (codes
``q + 2**(bits-1)`` and zero points ``z + 2**(bits-1)``, so ``w = scale * (codes - zeros)`` unchanged), which the
quantized loader keeps in the platform's formats where they hold the values exactly, as for GPTQ. Float8 weights
are dequantized here to float32: ``float32(weight) * float32(scale)``, one correctly rounded multiplication (exact
whenever the scale has at most 20 significant bits). Activation and KV-cache scales (``input_scale``,
``k_scale``, ...) are dropped: activations stay in the model's dtype.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator

import torch

from tokenmill.model_loader.group_quant_tensor import GroupQuantTensor, unpack_words
from tokenmill.model_loader.hf_quant_types import HFQuantConfig

logger = logging.getLogger(__name__)

PARTS = frozenset({"weight_packed", "weight_shape", "weight_scale", "weight_scale_inv", "weight_zero_point",
                   "weight_g_idx"})
DROPPED = frozenset({"input_scale", "input_zero_point", "output_scale", "output_zero_point", "k_scale", "v_scale"})
FLOAT8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
TILE_ROWS = 1024  # float8 rows dequantized at a time: the scale grid of a tile, not of the whole weight


def _row_scales(scale: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """``scale`` as ``[N, G]`` (one element: ``[N, 1]``).

    Raises:
        ValueError: neither one element nor ``N`` rows.
    """
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, 1)
    if scale.dim() == 1 and scale.shape[0] == n:
        return scale[:, None]
    if scale.dim() != 2 or scale.shape[0] != n:
        raise ValueError(f"{what}: weight_scale {tuple(scale.shape)} does not fit {n} output rows")
    return scale


def _zero_points(zero_point: torch.Tensor | None, n: int, groups: int, bits: int, what: str) -> torch.Tensor:
    """``[N, G]`` int16 zero points ``z + 2**(bits-1)`` (module docstring; none: the symmetric ``2**(bits-1)``)."""
    offset = 1 << (bits - 1)
    if zero_point is None:
        return torch.full((n, groups), offset, dtype=torch.int16)
    if zero_point.dtype == torch.int32 and zero_point.dim() == 2 and zero_point.shape[0] != n:
        stored = unpack_words(zero_point.t().contiguous(), bits)[:, :n].t()  # packed along the output rows
    else:
        stored = _row_scales(zero_point, n, what).to(torch.int16) + offset
    if stored.shape != (n, groups):
        raise ValueError(f"{what}: weight_zero_point {tuple(zero_point.shape)} does not fit scales [{n}, {groups}]")
    return stored.to(torch.int16).contiguous()


def _group_tensor(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, bits: int,
                  g_idx: torch.Tensor | None, what: str) -> GroupQuantTensor:
    """``GroupQuantTensor`` of stored codes ``[N, K]`` (``q + 2**(bits-1)``); groups of ``ceil(K / G)`` channels,
    the last one cut short, or ``g_idx``."""
    n, k = codes.shape
    scales = _row_scales(scale, n, what).contiguous()
    zeros = _zero_points(zero_point, n, scales.shape[1], bits, what)
    group = math.ceil(k / scales.shape[1])
    idx = None if g_idx is None else g_idx.to(torch.int64)
    if idx is None and k % group:
        idx = torch.arange(k) // group
    if idx is not None and torch.equal(idx, torch.arange(k) // group) and k % group == 0:
        idx = None
    return GroupQuantTensor(codes.to(torch.uint8).contiguous(), scales, zeros, bits, group, idx)


def unpack_pack_quantized(parts: dict[str, torch.Tensor], what: str) -> GroupQuantTensor:
    """A ``pack-quantized`` module's tensors (module docstring) as ``[N, K]`` rows.

    Raises:
        ValueError: a missing ``weight_shape`` / ``weight_scale``, or shapes that do not fit each other.
    """
    packed = parts["weight_packed"]
    if "weight_shape" not in parts or "weight_scale" not in parts:
        raise ValueError(f"{what}: weight_packed without weight_shape and weight_scale")
    n, k = (int(v) for v in parts["weight_shape"].reshape(-1).tolist())
    if packed.shape[0] != n or packed.shape[1] * 32 % k or packed.shape[1] * 32 // k not in (4, 8):
        raise ValueError(f"{what}: weight_packed {tuple(packed.shape)} does not hold 4- or 8-bit codes of a "
                         f"[{n}, {k}] weight")
    bits = packed.shape[1] * 32 // k
    codes = unpack_words(packed, bits)[:, :k]
    return _group_tensor(codes, parts["weight_scale"], parts.get("weight_zero_point"), bits,
                         parts.get("weight_g_idx"), what)


def dequantize_scaled(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
                      ) -> torch.Tensor:
    """``[N, K]`` float32 ``weight * scale`` (module docstring), ``scale`` one element, ``[N]``, ``[N, G]`` or one
    per ``block`` of the weight (``[ceil(N / bn), ceil(K / bk)]``).

    Raises:
        ValueError: a scale shape that does not fit the weight.
    """
    n, k = weight.shape
    s = scale.float()
    if s.numel() == 1:
        return weight.float() * s.reshape(())
    if s.dim() == 1 and s.shape[0] == n:
        s = s[:, None]
    if block is None:
        if s.dim() != 2 or n % s.shape[0] or k % s.shape[1]:
            raise ValueError(f"weight_scale {tuple(scale.shape)} does not divide a [{n}, {k}] weight")
        block = (n // s.shape[0], k // s.shape[1])
    bn, bk = block
    if s.dim() != 2 or s.shape != (math.ceil(n / bn), math.ceil(k / bk)):
        raise ValueError(f"weight scales {tuple(scale.shape)} do not fit a [{n}, {k}] weight in blocks of "
                         f"{list(block)}")
    out = torch.empty(n, k, dtype=torch.float32)
    step = max(bn, TILE_ROWS // bn * bn)
    for start in range(0, n, step):
        end = min(n, start + step)
        grid = s[start // bn: math.ceil(end / bn)].repeat_interleave(bn, 0)[: end - start].repeat_interleave(bk, 1)
        out[start:end] = weight[start:end].float() * grid[:, :k]
    return out


def _build(prefix: str, parts: dict[str, torch.Tensor], config: HFQuantConfig) -> torch.Tensor | GroupQuantTensor:
    what = f"{config.method} checkpoint: {prefix}"
    if "weight_packed" in parts:
        return unpack_pack_quantized(parts, what)
    weight = parts.get("weight")
    scale = parts.get("weight_scale", parts.get("weight_scale_inv"))
    if weight is None or scale is None:
        raise ValueError(f"{what} has {', '.join(sorted(parts))} but no "
                         f"{'weight_scale' if weight is not None else 'int8 or float8 weight'}")
    if weight.dtype == torch.int8:
        return _group_tensor(weight.to(torch.int16) + 128, scale, parts.get("weight_zero_point"), 8,
                             parts.get("weight_g_idx"), what)
    block = config.block_size
    if block is not None and tuple(scale.shape) != tuple(math.ceil(d / b) for d, b in zip(weight.shape, block)):
        block = None  # a per-tensor, per-row or per-group scale of a module outside the block scheme
    return dequantize_scaled(weight, scale, block)


def _complete(parts: dict[str, torch.Tensor], config: HFQuantConfig) -> bool:
    if "weight_packed" in parts:
        needed = {"weight_shape", "weight_scale"}
    elif "weight" in parts:
        if parts["weight"].dtype in FLOAT8:
            return bool({"weight_scale", "weight_scale_inv"} & parts.keys())
        needed = {"weight_scale"}
    else:
        return False
    if config.desc_act:
        needed.add("weight_g_idx")
    if config.zero_points:
        needed.add("weight_zero_point")
    return needed <= parts.keys()


def iterate_scaled_quant_weights(weights: Iterable[tuple[str, torch.Tensor]], config: HFQuantConfig
                                 ) -> Iterator[tuple[str, torch.Tensor | GroupQuantTensor]]:
    """``weights`` with each quantized module's tensors replaced by ``<module>.weight``: a
    :class:`GroupQuantTensor` (integer schemes) or a float32 tensor (float8), yielded as soon as the module's
    tensors are all read (optional zero points and ``g_idx`` the config announces but a module lacks: at the
    end). Float tensors (modules in the config's ``ignore`` list, norms, embeddings) pass unchanged; activation and
    KV-cache scales are dropped (module docstring).

    Raises:
        ValueError: a module's tensors are incomplete or their shapes do not fit.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    dropped = 0
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf in DROPPED and prefix:
            dropped += 1
            continue
        quantized_weight = leaf == "weight" and (tensor.dtype == torch.int8 or tensor.dtype in FLOAT8)
        if not prefix or not (leaf in PARTS or quantized_weight):
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if _complete(parts, config):
            del pending[prefix]
            yield f"{prefix}.weight", _build(prefix, parts, config)
    for prefix, parts in pending.items():
        yield f"{prefix}.weight", _build(prefix, parts, config)
    if dropped:
        logger.info("%s checkpoint: %d activation/KV-cache scales not used (activations and the KV cache stay in the "
                    "model's dtype)", config.method, dropped)
