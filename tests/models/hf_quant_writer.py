"""Tiny random Llama checkpoints in AWQ (GEMM) and GPTQ layouts, packed here from their documented formats
(``quantization_config``; tensors as AutoAWQ and AutoGPTQ / GPTQModel write them), and the float32 model of
their dequantized values (``save_pretrained``) as the reference."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file

from tests.conftest import build_tiny_llama

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_NIBBLE_CHANNEL = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: nibble i holds channel order[i]
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)


@dataclass(frozen=True)
class Case:
    method: str  # "awq" or "gptq"
    bits: int
    group: int
    # GPTQ g_idx: "" (consecutive groups), "channels" (a random channel order, the same for modules that share
    # their input, as GPTQ's order by the inputs' Hessian is), "channels-own" (one order per module), "blocks"
    # (runs of 32 channels moved)
    act_order: str = ""
    fmt: str = "gptq"  # GPTQ checkpoint_format: "gptq" (zero points stored minus one) or "gptq_v2"
    narrow: bool = False  # GPTQ scale 2 max|w| / (2**bits - 2): codes never reach 0, so q - z >= -(2**(bits-1) - 1)

    @property
    def name(self) -> str:
        return f"{self.method}{self.bits}-g{self.group}{'-' + self.act_order if self.act_order else ''}" \
               f"{'-v2' if self.fmt == 'gptq_v2' else ''}{'-narrow' if self.narrow else ''}"


@dataclass
class Quantized:
    """One module's codes ``[N, K]``, scales ``[N, G]`` float16, zero points ``[N, G]`` and group of each input
    channel ``[K]``; ``values`` the dequantized weight (float32, exact)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    groups: torch.Tensor

    @property
    def values(self) -> torch.Tensor:
        # exact in float32: (q - z) has at most 9 bits and a float16 scale 11
        return (self.codes - self.zeros[:, self.groups]).float() * self.scales.float()[:, self.groups]


def channel_groups(case: Case, k: int, gen: torch.Generator) -> torch.Tensor:
    """``[K]`` the group of each input channel (GPTQ's g_idx)."""
    if case.act_order.startswith("channels"):  # desc_act: channel perm[i] is quantized i-th, in group i // group
        perm = torch.randperm(k, generator=gen)
        groups = torch.empty(k, dtype=torch.int64)
        groups[perm] = torch.arange(k) // case.group
        return groups
    if case.act_order == "blocks":  # an order that moves whole runs of 32 channels
        runs = torch.randperm(k // 32, generator=gen)
        groups = torch.empty(k // 32, dtype=torch.int64)
        groups[runs] = torch.arange(k // 32) * 32 // case.group
        return groups.repeat_interleave(32)
    return torch.arange(k) // case.group


SHARED_INPUT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}


def quantize(w: torch.Tensor, case: Case, gen: torch.Generator) -> Quantized:
    """Round-to-nearest group quantization of ``w [N, K]``: AWQ asymmetric (zero point ``round(-min / s)``),
    GPTQ symmetric (zero point ``2**(bits-1)``, scale ``2 max|w| / (2**bits - 1)``: the most negative weight of a
    group rounds to code 0, ``q - z = -2**(bits-1)``)."""
    n, k = w.shape
    maxq = 2 ** case.bits - 1
    groups = channel_groups(case, k, gen)
    order = torch.argsort(groups, stable=True)
    blocks = w[:, order].reshape(n, k // case.group, case.group)
    if case.method == "awq":
        lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
        scales = ((hi - lo) / maxq).clamp(min=1e-5).half()
        zeros = (-lo / scales.float()).round().clamp(0, maxq)
    else:
        scales = (2 * blocks.abs().amax(-1) / (maxq - case.narrow)).clamp(min=1e-5).half()
        zeros = torch.full_like(scales, (maxq + 1) // 2, dtype=torch.float32)
    codes = (blocks / scales.float()[..., None]).round() + zeros[..., None]
    codes_sorted = codes.clamp(0, maxq).reshape(n, k)
    out = torch.empty_like(codes_sorted)
    out[:, order] = codes_sorted
    return Quantized(out.to(torch.int64), scales, zeros.to(torch.int64), groups)


def _words(values: torch.Tensor, bits: int, channel_of_slot: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[R, C]`` integer codes -> ``[R, C * bits / 32]`` int32, ``32 / bits`` consecutive codes per word, slot
    ``i`` (bits ``i * bits ...``) holding code ``channel_of_slot[i]`` of its run (default: code ``i``)."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0], -1, per)
    if channel_of_slot is not None:
        v = v[..., list(channel_of_slot)]
    word = sum(v[..., i] << (bits * i) for i in range(per))
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def pack(q: Quantized, case: Case) -> dict[str, torch.Tensor]:
    """The module's checkpoint tensors in ``case``'s format."""
    if case.method == "awq":
        return {"qweight": _words(q.codes.t(), 4, AWQ_NIBBLE_CHANNEL),
                "qzeros": _words(q.zeros.t(), 4, AWQ_NIBBLE_CHANNEL), "scales": q.scales.t().contiguous()}
    stored = q.zeros - (1 if case.fmt == "gptq" else 0)
    return {"qweight": _words(q.codes, case.bits).t().contiguous(),
            "qzeros": _words(stored.t() & (2 ** case.bits - 1), case.bits),
            "scales": q.scales.t().contiguous(), "g_idx": q.groups.to(torch.int32)}


def quant_config(case: Case) -> dict:
    if case.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": case.group, "version": "gemm", "zero_point": True}
    return {"quant_method": "gptq", "bits": case.bits, "group_size": case.group, "desc_act": bool(case.act_order),
            "sym": True, "checkpoint_format": case.fmt}


def write_checkpoints(folder: str, case: Case, seed: int = 0, base: str | None = None
                      ) -> tuple[str, str, dict[str, Quantized]]:
    """A quantized checkpoint of ``case`` and the float32 model of its dequantized values, under ``folder``, made
    from the random float model ``base`` (a Hugging Face directory; default: one written with ``seed``).

    Returns:
        ``(quantized_dir, float_dir, {module name: Quantized})``.
    """
    gen = torch.Generator().manual_seed(seed)

    def convert(prefix: str, tensor: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor, Quantized]:
        nonlocal gen
        if case.act_order == "channels":
            gen = torch.Generator().manual_seed(seed * 10 + SHARED_INPUT[prefix.rpartition(".")[2]])
        q = quantize(tensor, case, gen)
        return pack(q, case), q.values, q

    base = base or build_tiny_llama(os.path.join(folder, "base"), seed=seed, **TINY)
    return write_quantized_pair(folder, base, convert, quant_config(case))


def write_quantized_pair(folder: str, base: str, convert: Callable[[str, torch.Tensor], Any], config: dict
                         ) -> tuple[str, str, dict[str, Any]]:
    """The linear weights of the float model ``base`` converted by ``convert(module, weight)`` (``None``: the
    module stays float, else ``(checkpoint tensors, dequantized float32 values, record)``) into
    ``folder/quantized`` (with ``config`` as ``quantization_config``), and the float32 model of the values
    (``save_pretrained``) into ``folder/float``.

    Returns:
        ``(quantized_dir, float_dir, {module name: record})``.
    """
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    modules: dict[str, Any] = {}
    qstate = {}
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".")
        converted = convert(prefix, tensor) if leaf == "weight" and prefix.rpartition(".")[2] in LINEARS else None
        if converted is None:
            qstate[name] = tensor
            continue
        tensors, values, modules[prefix] = converted
        qstate.update({f"{prefix}.{k}": v.contiguous() for k, v in tensors.items()})
        state[name].copy_(values)
    qdir, fdir = os.path.join(folder, "quantized"), os.path.join(folder, "float")
    model.load_state_dict(state)
    model.save_pretrained(fdir)
    save_quantized(qdir, fdir, qstate, config)
    return qdir, fdir, modules


def save_quantized(qdir: str, fdir: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """``tensors`` as ``qdir``'s checkpoint, with the float model ``fdir``'s ``config.json`` plus ``config`` as
    its ``quantization_config``."""
    os.makedirs(qdir)
    save_file(tensors, os.path.join(qdir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(fdir, "config.json")) as f:
        hf = json.load(f)
    hf["quantization_config"] = config
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(hf, f)
