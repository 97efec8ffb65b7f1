"""``quantization_config`` of a Hugging Face checkpoint: which pre-quantized formats tokenmill loads.

A checkpoint quantized by AutoAWQ (``quant_method: awq``, GEMM layout) or by AutoGPTQ / GPTQModel / optimum
(``quant_method: gptq``) keeps its linear weights as packed integer codes with per-group scales and zero points;
``tokenmill.model_loader.hf_quant_weights`` unpacks them and the platform's quantized formats take them as they are
(docs/quantization.md). llm-compressor's ``compressed-tensors`` checkpoints
(``tokenmill.model_loader.compressed_tensors_config``) and FP8 checkpoints (``quant_method: fp8``, per-tensor or
block-wise scales) are read by ``tokenmill.model_loader.scaled_quant_weights``. Any other method, bit width or
layout is refused when the engine starts, before weights are read.
"""

from __future__ import annotations

from typing import Any

from tokenmill.model_loader.hf_quant_types import SUPPORTED_METHODS, HFQuantConfig, supported_methods

__all__ = ["SUPPORTED_METHODS", "HFQuantConfig", "parse_hf_quant_config", "supported_methods"]


def parse_hf_quant_config(hf_config: Any) -> HFQuantConfig | None:
    """``hf_config.quantization_config`` checked, or ``None`` when the checkpoint has none.

    Raises:
        ValueError: a method, bit width, AWQ version, GPTQ checkpoint format, compressed-tensors scheme or FP8
            block size tokenmill does not load (the message lists the supported methods).
    """
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    method = str(raw.get("quant_method", "")).lower()
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"quantization_config: quant_method {method or None!r} is not supported; "
                         f"supported: {supported_methods()}")
    if method == "compressed-tensors":
        from tokenmill.model_loader.compressed_tensors_config import parse_compressed_tensors_config

        return parse_compressed_tensors_config(raw)
    if method == "fp8":
        return _parse_fp8(raw)
    bits = int(raw.get("bits", raw.get("w_bit", 0)) or 0)
    if bits not in SUPPORTED_METHODS[method]:
        raise ValueError(f"quantization_config: {method} with bits={bits} is not supported; "
                         f"supported: {supported_methods()}")
    group_size = int(raw.get("group_size", raw.get("q_group_size", -1)) or -1)
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"quantization_config: group_size must be positive or -1, got {group_size}")
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config: AWQ version {version!r} is not supported (only 'gemm'); "
                             f"supported: {supported_methods()}")
        if not raw.get("zero_point", True):
            raise ValueError("quantization_config: AWQ without zero points is not supported; "
                             f"supported: {supported_methods()}")
        return HFQuantConfig("awq", bits, group_size)  # modules_to_not_convert are stored as float weights
    fmt = str(raw.get("checkpoint_format", raw.get("format", "gptq")) or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config: GPTQ checkpoint_format {fmt!r} is not supported "
                         f"(gptq, gptq_v2); supported: {supported_methods()}")
    return HFQuantConfig("gptq", bits, group_size, desc_act=bool(raw.get("desc_act", False)),
                         zero_offset=1 if fmt == "gptq" else 0)


def _parse_fp8(raw: dict[str, Any]) -> HFQuantConfig:
    """``quant_method: fp8`` (vLLM's and transformers' FP8 checkpoints): float8 weights with a per-tensor
    ``weight_scale``, or with ``weight_block_size`` a ``weight_scale_inv`` per block (DeepSeek-V3, Qwen3-FP8).
    Input scales of ``activation_scheme: static`` are not used (activations stay in the model's dtype)."""
    scheme = str(raw.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config: fp8 activation_scheme {scheme!r} is not supported (dynamic, static); "
                         f"supported: {supported_methods()}")
    block = raw.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise ValueError(f"quantization_config: fp8 weight_block_size must be two positive integers, got {block!r}")
        block = (int(block[0]), int(block[1]))
    return HFQuantConfig("fp8", 8, -1, block_size=block)
