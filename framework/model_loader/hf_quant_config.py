"""``quantization_config`` of a Hugging Face checkpoint: which pre-quantized formats tokenmill loads.

A checkpoint quantized by AutoAWQ (``quant_method: awq``, GEMM layout) or by AutoGPTQ / GPTQModel / optimum
(``quant_method: gptq``) keeps its linear weights as packed integer codes with per-group scales and zero points;
``tokenmill.model_loader.hf_quant_weights`` unpacks them and the platform's quantized formats take them as they are
(docs/quantization.md). Any other method, bit width or layout is refused when the engine starts, before weights are
read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# method -> supported bit widths
SUPPORTED_METHODS: dict[str, tuple[int, ...]] = {"awq": (4,), "gptq": (4, 8)}


@dataclass(frozen=True)
class HFQuantConfig:
    """The fields of ``quantization_config`` the loader uses.

    Attributes:
        method: ``"awq"`` or ``"gptq"``.
        bits: bits per weight code (AWQ 4; GPTQ 4 or 8).
        group_size: input channels sharing one scale and zero point; ``-1`` in the file (one group per row)
            is kept as ``-1`` and resolved per layer.
        desc_act: GPTQ's activation order: the checkpoint's ``g_idx`` assigns each input channel its group.
        zero_offset: added to a stored zero point to get the one the format subtracts: 1 for GPTQ's
            ``checkpoint_format`` ``"gptq"`` (v1, which stores ``z - 1``), 0 for ``"gptq_v2"`` and AWQ.
    """

    method: str
    bits: int
    group_size: int
    desc_act: bool = False
    zero_offset: int = 0


def _supported() -> str:
    return ", ".join(f"{m} ({'/'.join(map(str, b))}-bit)" for m, b in SUPPORTED_METHODS.items())


def parse_hf_quant_config(hf_config: Any) -> HFQuantConfig | None:
    """``hf_config.quantization_config`` checked, or ``None`` when the checkpoint has none.

    Raises:
        ValueError: a method, bit width, AWQ version or GPTQ checkpoint format tokenmill does not load (the message
            lists the supported methods).
    """
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    method = str(raw.get("quant_method", "")).lower()
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"quantization_config: quant_method {method or None!r} is not supported; "
                         f"supported: {_supported()}")
    bits = int(raw.get("bits", raw.get("w_bit", 0)) or 0)
    if bits not in SUPPORTED_METHODS[method]:
        raise ValueError(f"quantization_config: {method} with bits={bits} is not supported; supported: {_supported()}")
    group_size = int(raw.get("group_size", raw.get("q_group_size", -1)) or -1)
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"quantization_config: group_size must be positive or -1, got {group_size}")
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config: AWQ version {version!r} is not supported (only 'gemm'); "
                             f"supported: {_supported()}")
        if not raw.get("zero_point", True):
            raise ValueError("quantization_config: AWQ without zero points is not supported; "
                             f"supported: {_supported()}")
        return HFQuantConfig("awq", bits, group_size)  # modules_to_not_convert are stored as float weights
    fmt = str(raw.get("checkpoint_format", raw.get("format", "gptq")) or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config: GPTQ checkpoint_format {fmt!r} is not supported "
                         f"(gptq, gptq_v2); supported: {_supported()}")
    return HFQuantConfig("gptq", bits, group_size, desc_act=bool(raw.get("desc_act", False)),
                         zero_offset=1 if fmt == "gptq" else 0)
