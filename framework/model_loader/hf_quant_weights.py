"""AWQ and GPTQ linear weights of a Hugging Face checkpoint as :class:`GroupQuantTensor` rows.

A quantized module ``p`` is stored as ``p.qweight``, ``p.qzeros``, ``p.scales`` (and for GPTQ ``p.g_idx``), all
int32-packed; :func:`iterate_hf_quant_weights` collects them and yields ``p.weight`` as one
:class:`~tokenmill.model_loader.group_quant_tensor.GroupQuantTensor` ``[out, in]``, so the models' ``load_weights``
route it like a float weight. Layouts (``K`` input and ``N`` output features, ``G`` groups, value
``w = scale * (q - z)``):

* AWQ, GEMM version (AutoAWQ): ``qweight [K, N / 8]``, eight codes of consecutive output channels per int32 in the
  nibble order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (nibble ``i``, bits ``4i..4i+3``, holds channel ``8j + order[i]``);
  ``qzeros [G, N / 8]`` the same; ``scales [G, N]``.
* GPTQ (AutoGPTQ, GPTQModel, optimum): ``qweight [K * bits / 32, N]``, ``32 / bits`` codes of consecutive input
  channels per int32, lowest bits first; ``qzeros [G, N * bits / 32]`` the same along outputs; ``scales [G, N]``;
  ``g_idx [K]``. ``checkpoint_format`` ``"gptq"`` (v1, the default) stores ``z - 1`` (masked to ``bits``), so
  ``z = stored + 1``; ``"gptq_v2"`` stores ``z``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tokenmill.model_loader.group_quant_tensor import GroupQuantTensor, unpack_words
from tokenmill.model_loader.hf_quant_types import HFQuantConfig

PARTS = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # channel held by nibble i of an AWQ word


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ words ``[R, N / 8]`` -> codes ``[R, N]`` int16 in channel order."""
    nibbles = unpack_words(packed, 4).reshape(packed.shape[0], -1, 8)
    inverse = [AWQ_ORDER.index(c) for c in range(8)]  # nibble holding channel c
    return nibbles[..., inverse].reshape(packed.shape[0], -1)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, config: HFQuantConfig
               ) -> GroupQuantTensor:
    """An AWQ GEMM module's tensors (module docstring) as ``[N, K]`` rows.

    Raises:
        ValueError: shapes that do not fit each other.
    """
    k, n = qweight.shape[0], scales.shape[1]
    if qweight.shape[1] * 8 != n or qzeros.shape != (scales.shape[0], n // 8):
        raise ValueError(f"AWQ: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                         f"{tuple(scales.shape)} do not fit each other")
    codes = _awq_columns(qweight).t().to(torch.uint8).contiguous()
    zeros = _awq_columns(qzeros).t().contiguous()
    group = config.group_size if config.group_size > 0 else k
    return GroupQuantTensor(codes, scales.t().contiguous(), zeros, config.bits, group)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                config: HFQuantConfig) -> GroupQuantTensor:
    """A GPTQ module's tensors (module docstring) as ``[N, K]`` rows; ``g_idx`` is kept only when it differs
    from consecutive groups.

    Raises:
        ValueError: shapes that do not fit each other.
    """
    bits, per_word = config.bits, 32 // config.bits
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    if scales.shape[1] != n or qzeros.shape != (scales.shape[0], n // per_word):
        raise ValueError(f"GPTQ: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                         f"{tuple(scales.shape)} do not fit each other")
    codes = unpack_words(qweight.t(), bits).to(torch.uint8).contiguous()  # [N, K]
    zeros = (unpack_words(qzeros, bits) + config.zero_offset).t().contiguous()
    group = config.group_size if config.group_size > 0 else k
    idx = None
    if g_idx is not None:
        idx = g_idx.to(torch.int64)
        if torch.equal(idx, torch.arange(k) // group) and k % group == 0:
            idx = None
    return GroupQuantTensor(codes, scales.t().contiguous(), zeros, bits, group, idx)


def iterate_hf_quant_weights(weights: Iterable[tuple[str, torch.Tensor]], config: HFQuantConfig
                             ) -> Iterator[tuple[str, torch.Tensor | GroupQuantTensor]]:
    """``weights`` with each quantized module's packed tensors replaced by ``<module>.weight``, a
    :class:`GroupQuantTensor`, yielded as soon as the module's tensors are all read (GPTQ's ``g_idx`` may be
    absent: then at the end). Other tensors pass unchanged.

    compressed-tensors and FP8 checkpoints go to
    :func:`tokenmill.model_loader.scaled_quant_weights.iterate_scaled_quant_weights`.

    Raises:
        ValueError: a module lacks ``qweight``, ``qzeros`` or ``scales``, or its shapes do not fit.
    """
    if config.method in ("compressed-tensors", "fp8"):
        from tokenmill.model_loader.scaled_quant_weights import iterate_scaled_quant_weights

        yield from iterate_scaled_quant_weights(weights, config)
        return
    pending: dict[str, dict[str, torch.Tensor]] = {}
    needed = set(PARTS[:3]) | ({"g_idx"} if config.method == "gptq" else set())

    def build(prefix: str, parts: dict[str, torch.Tensor]) -> GroupQuantTensor:
        missing = set(PARTS[:3]) - parts.keys()
        if missing:
            raise ValueError(f"{config.method} checkpoint: {prefix} has no {', '.join(sorted(missing))}")
        if config.method == "awq":
            return unpack_awq(parts["qweight"], parts["qzeros"], parts["scales"], config)
        return unpack_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), config)

    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in PARTS or not prefix:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if needed <= parts.keys():
            del pending[prefix]
            yield f"{prefix}.weight", build(prefix, parts)
    for prefix, parts in pending.items():
        yield f"{prefix}.weight", build(prefix, parts)
