"""Tiny random Llama checkpoints in compressed-tensors and FP8 layouts, quantized and packed here from the formats'
documentation (compressed-tensors' ``pack-quantized``, ``int-quantized`` and ``float-quantized`` compressors;
``quant_method: fp8`` per-tensor and block-wise), and the float32 model of their dequantized values."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from tests.models.hf_quant_writer import (
    SHARED_INPUT,
    Case,
    Quantized,
    _words,
    channel_groups,
    save_quantized,
    write_quantized_pair,
)

FP8_MAX = 448.0  # largest float8_e4m3fn


@dataclass(frozen=True)
class ScaledCase:
    kind: str  # "pack" (W4A16 / W8A16), "int" (W8A8 int-quantized), "ct-fp8" (float-quantized), "fp8"
    bits: int = 8
    group: int = 0  # input channels per scale; 0: one scale per row (channel-wise)
    symmetric: bool = True
    scale_dtype: torch.dtype = torch.float16
    ignore: tuple[str, ...] = ("lm_head",)
    block: tuple[int, int] | None = None  # fp8: weight_block_size
    static: bool = False  # fp8: activation_scheme static (input_scale tensors written)
    old_zero_points: bool = False  # pack-quantized: zero points int8 [N, G] unpacked (older compressed-tensors)
    # symmetric scale max|w| / (2**(bits-1) - 1): codes never reach -2**(bits-1) (compressed-tensors' own
    # max|w| / ((2**bits - 1) / 2) gives -128 wherever a group's largest magnitude is negative)
    narrow: bool = False
    act_order: bool = False  # actorder "group": weight_g_idx, one random channel order per input (as GPTQ's)

    @property
    def name(self) -> str:
        if self.kind in ("fp8", "ct-fp8"):
            parts = [self.kind, "channel" if self.kind == "ct-fp8" else "block" if self.block else "tensor"]
        else:
            parts = [self.kind, f"w{self.bits}", f"g{self.group}" if self.group else "channel"]
        parts += [] if self.symmetric else ["asym"]
        parts += ["bf16"] if self.scale_dtype == torch.bfloat16 else []
        parts += ["ignore"] if len(self.ignore) > 1 else []
        parts += [f"{self.block[0]}x{self.block[1]}"] if self.block else []
        parts += ["static"] if self.static else []
        parts += ["oldzp"] if self.old_zero_points else []
        parts += ["narrow"] if self.narrow else []
        parts += ["actorder"] if self.act_order else []
        return "-".join(parts)

    def ignored(self, module: str) -> bool:
        """Whether ``ignore`` names ``module`` (a name, or ``re:`` and a regular expression)."""
        return any(re.fullmatch(p[3:], module) if p.startswith("re:") else p == module for p in self.ignore)


def quantize_int(w: torch.Tensor, case: ScaledCase, groups: torch.Tensor | None = None) -> Quantized:
    """compressed-tensors' min-max round-to-nearest int quantization of ``w [N, K]`` per group (or row): symmetric
    ``scale = max|w| / ((2**bits - 1) / 2)``, zero point 0; asymmetric ``scale = (max - min) / (2**bits - 1)``
    (``min <= 0 <= max``), zero point ``round(qmin - min / scale)``; codes ``clamp(round(w / scale) + zp, qmin,
    qmax)``. Returned with codes and zero points offset by ``2**(bits-1)`` (as the packed format stores them).
    ``groups`` ``[K]``: the group of each input channel (default: consecutive groups)."""
    n, k = w.shape
    group = case.group or k
    groups = torch.arange(k) // group if groups is None else groups
    order = torch.argsort(groups, stable=True)
    qmin, qmax = -(1 << (case.bits - 1)), (1 << (case.bits - 1)) - 1
    blocks = w[:, order].reshape(n, k // group, group)
    if case.symmetric:
        scales = (blocks.abs().amax(-1) / (qmax if case.narrow else (qmax - qmin) / 2)).clamp(min=1e-5)
        scales = scales.to(case.scale_dtype)
        zeros = torch.zeros_like(scales, dtype=torch.float32)
    else:
        lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
        scales = ((hi - lo) / (qmax - qmin)).clamp(min=1e-5).to(case.scale_dtype)
        zeros = (qmin - lo / scales.float()).round().clamp(qmin, qmax)
    sorted_codes = ((blocks / scales.float()[..., None]).round() + zeros[..., None]).clamp(qmin, qmax).reshape(n, k)
    codes = torch.empty_like(sorted_codes)
    codes[:, order] = sorted_codes
    offset = 1 << (case.bits - 1)
    return Quantized((codes + offset).to(torch.int64), scales, (zeros + offset).to(torch.int64), groups)


def pack_int(q: Quantized, case: ScaledCase) -> dict[str, torch.Tensor]:
    """A module's compressed-tensors tensors: ``pack-quantized`` (codes and zero points packed into int32, the
    zero points along the output rows) or ``int-quantized`` (int8 codes)."""
    n, k = q.codes.shape
    offset = 1 << (case.bits - 1)
    scale = q.scales if case.group else q.scales.reshape(n, 1)
    if case.kind == "int":
        out = {"weight": (q.codes - offset).to(torch.int8), "weight_scale": scale}
        if not case.symmetric:
            out["weight_zero_point"] = (q.zeros - offset).to(torch.int8)
        return out
    out = {"weight_packed": _words(q.codes, case.bits), "weight_shape": torch.tensor([n, k]), "weight_scale": scale}
    if case.act_order:
        out["weight_g_idx"] = q.groups.to(torch.int32)
    if not case.symmetric:
        out["weight_zero_point"] = ((q.zeros - offset).to(torch.int8) if case.old_zero_points
                                    else _words(q.zeros.t(), case.bits).t())
    return out


def quantize_fp8(w: torch.Tensor, case: ScaledCase) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``w`` as float8 E4M3 with float32 scales (one per tensor, row or ``block``), each scale a float16 value so
    that ``float8 * scale`` is exact in float32; returns the module's tensors and the dequantized values."""
    n, k = w.shape
    bn, bk = case.block or ((n, k) if case.kind == "fp8" else (1, k))
    grid = torch.zeros(math.ceil(n / bn), math.ceil(k / bk))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax()
    scales = (grid / FP8_MAX).clamp(min=1e-6).half().float()
    full = scales.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    codes = (w / full).to(torch.float8_e4m3fn)
    values = codes.float() * full
    if case.kind == "ct-fp8":
        return {"weight": codes, "weight_scale": scales.reshape(n, 1)}, values
    out = {"weight": codes}
    out["weight_scale_inv" if case.block else "weight_scale"] = scales if case.block else scales.reshape(())
    if case.static:
        out["input_scale"] = torch.tensor(0.05)
    return out, values


def quant_config(case: ScaledCase) -> dict:
    """``quantization_config`` of ``case`` (compressed-tensors as llm-compressor writes it, or FP8's)."""
    if case.kind == "fp8":
        config = {"quant_method": "fp8", "activation_scheme": "static" if case.static else "dynamic"}
        return config | ({"weight_block_size": list(case.block)} if case.block else {})
    kind = "float" if case.kind == "ct-fp8" else "int"
    weights = {"num_bits": case.bits, "type": kind, "symmetric": case.symmetric, "dynamic": False,
               "strategy": "group" if case.group else "channel", "group_size": case.group or None,
               "actorder": "group" if case.act_order else None, "observer": "minmax", "block_structure": None}
    acts = None
    if case.kind in ("int", "ct-fp8"):
        acts = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": True, "strategy": "token",
                "group_size": None, "observer": None}
    fmt = {"pack": "pack-quantized", "int": "int-quantized", "ct-fp8": "float-quantized"}[case.kind]
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None, "format": fmt}},
            "ignore": list(case.ignore), "kv_cache_scheme": None, "sparsity_config": {}}


def write_scaled_checkpoints(folder: str, case: ScaledCase, base: str
                             ) -> tuple[str, str, dict[str, Quantized | torch.Tensor]]:
    """A checkpoint of ``case`` made from the float model ``base`` and the float32 model of its values.

    Returns:
        ``(quantized_dir, float_dir, {module: Quantized (integer schemes) or the float32 values (FP8)})``; modules
        ``case.ignore`` names are left out (float in both).
    """
    def convert(prefix: str, tensor: torch.Tensor):
        if case.ignored(prefix):
            return None
        if case.kind in ("fp8", "ct-fp8"):
            tensors, values = quantize_fp8(tensor, case)
            return tensors, values, values
        groups = None
        if case.act_order:
            gen = torch.Generator().manual_seed(10 + SHARED_INPUT[prefix.rpartition(".")[2]])
            groups = channel_groups(Case("gptq", case.bits, case.group, act_order="channels"), tensor.shape[1], gen)
        q = quantize_int(tensor, case, groups)
        return pack_int(q, case), q.values, q

    return write_quantized_pair(folder, base, convert, quant_config(case))


def write_moe_checkpoints(folder: str, case: ScaledCase, base: str) -> tuple[str, str]:
    """A mixture-of-experts model ``base`` (transformers' fused ``experts.gate_up_proj [E, 2I, H]`` /
    ``experts.down_proj [E, H, I]``) with each expert's projections quantized as ``case`` under their per-expert
    names (``experts.<e>.gate_proj``, as llm-compressor writes them; other tensors float), and the float model of
    the values. Returns ``(quantized_dir, float_dir)``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    fused = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
    qstate = {}
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".experts") or leaf not in fused:
            qstate[name] = tensor
            continue
        for e in range(tensor.shape[0]):
            values = []
            for part, w in zip(fused[leaf], tensor[e].chunk(len(fused[leaf]), 0)):
                q = quantize_int(w, case)
                qstate.update({f"{prefix}.{e}.{part}.{k}": v.contiguous() for k, v in pack_int(q, case).items()})
                values.append(q.values)
            tensor[e].copy_(torch.cat(values))
    model.load_state_dict(state)
    qdir, fdir = f"{folder}/quantized", f"{folder}/float"
    model.save_pretrained(fdir)
    save_quantized(qdir, fdir, qstate, quant_config(case))
    return qdir, fdir
