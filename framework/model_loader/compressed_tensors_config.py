"""``quantization_config`` of a compressed-tensors checkpoint (``quant_method: compressed-tensors``, as
llm-compressor writes them): which of its schemes tokenmill loads.

The config has ``config_groups``, each a scheme with ``weights`` (``num_bits``, ``type`` ``int`` or ``float``,
``symmetric``, ``strategy`` ``tensor`` / ``channel`` / ``group`` / ``block``, ``group_size``, ``block_structure``,
``actorder``), optional ``input_activations`` and a ``format`` (per group, or the config's own ``format``);
``ignore`` names the modules left in float (their tensors in the checkpoint are plain ``weight`` tensors, which is
how the loader tells them apart: a module's format follows from the tensors it has,
``tokenmill.model_loader.scaled_quant_weights``). Loaded:

* ``pack-quantized``, ``int`` weights of 4 or 8 bits, any strategy but ``block``, symmetric or not (W4A16,
  W8A16);
* ``int-quantized`` / ``naive-quantized``, ``int`` 8-bit weights, with 8-bit ``int`` input activations or none
  (W8A8: the weights are kept exactly; activations are not quantized to 8 bits, the layer multiplies them in
  the model's dtype or the CPU plugin's 14-bit blocks);
* ``float-quantized`` / ``naive-quantized``, ``float`` 8-bit weights (FP8 E4M3), with float 8-bit input
  activations or none (dequantized to the model's dtype at load).

Anything else (NVFP4, MXFP4, 2:4 sparsity, ``dense``, output activation quantization, transforms) is refused
before any weight is read.
"""

from __future__ import annotations

from typing import Any

from tokenmill.model_loader.hf_quant_types import HFQuantConfig, supported_methods

INT_FORMATS = frozenset({"pack-quantized", "int-quantized", "naive-quantized"})
FLOAT_FORMATS = frozenset({"float-quantized", "naive-quantized"})
STRATEGIES = frozenset({"tensor", "channel", "group", "block"})


def _error(group: str, what: str) -> ValueError:
    return ValueError(f"quantization_config: compressed-tensors config_groups[{group!r}]: {what} is not supported; "
                      f"supported: {supported_methods()}")


def _check_weights(name: str, fmt: str, weights: dict[str, Any]) -> tuple[int, bool, list[int] | None]:
    """``(bits, symmetric, block_structure)`` of a group's weight scheme.

    Raises:
        ValueError: a type, width, strategy or format tokenmill does not load.
    """
    kind = str(weights.get("type", "int")).lower()
    bits = int(weights.get("num_bits", 8))
    strategy = str(weights.get("strategy") or ("group" if weights.get("group_size") else "tensor")).lower()
    symmetric = bool(weights.get("symmetric", True))
    if kind == "int" and fmt in INT_FORMATS:
        widths = (4, 8) if fmt == "pack-quantized" else (8,)
        if bits not in widths:
            raise _error(name, f"{fmt} int weights of {bits} bits")
        if strategy not in STRATEGIES - {"block"}:
            raise _error(name, f"{fmt} int weights with strategy {strategy!r}")
    elif kind == "float" and fmt in FLOAT_FORMATS:
        if bits != 8:
            raise _error(name, f"{fmt} float weights of {bits} bits")
        if strategy not in STRATEGIES:
            raise _error(name, f"{fmt} float weights with strategy {strategy!r}")
        if not symmetric:
            raise _error(name, f"{fmt} float weights with zero points")
    else:
        raise _error(name, f"format {fmt!r} with {kind} weights")
    if strategy == "group" and int(weights.get("group_size") or 0) <= 0:
        raise _error(name, "strategy 'group' without a positive group_size")
    block = weights.get("block_structure")
    if strategy == "block":
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise _error(name, f"strategy 'block' with block_structure {block!r}")
        block = [int(b) for b in block]
    return bits, symmetric, block if strategy == "block" else None


def parse_compressed_tensors_config(raw: dict[str, Any]) -> HFQuantConfig:
    """A compressed-tensors ``quantization_config`` (module docstring) checked.

    Returns:
        ``HFQuantConfig("compressed-tensors", ...)``: ``bits`` the widest weight scheme, ``desc_act`` when a group
        stores ``weight_g_idx`` (``actorder: group``), ``zero_points`` when a group is asymmetric,
        ``block_size`` the ``block_structure`` of a ``block`` scheme.

    Raises:
        ValueError: no config groups, or a scheme, format, sparsity or transform tokenmill does not load (the
            message lists the supported methods).
    """
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config: compressed-tensors without config_groups is not supported; "
                         f"supported: {supported_methods()}")
    sparsity = raw.get("sparsity_config") or {}
    if sparsity and str(sparsity.get("format", "dense")).lower() != "dense":
        raise ValueError(f"quantization_config: compressed-tensors sparsity format {sparsity.get('format')!r} is not "
                         f"supported; supported: {supported_methods()}")
    if raw.get("transform_config"):
        raise ValueError("quantization_config: compressed-tensors transforms (transform_config) are not supported; "
                         f"supported: {supported_methods()}")
    widths, blocks, asymmetric, g_idx = [], [], False, False
    for name, group in groups.items():
        fmt = str(group.get("format") or raw.get("format") or "").lower()
        weights = group.get("weights")
        if not weights:
            raise _error(name, "a scheme without weight quantization")
        bits, symmetric, block = _check_weights(name, fmt, weights)
        acts = group.get("input_activations")
        if acts and (int(acts.get("num_bits", 8)) != 8 or str(acts.get("type", "int")).lower()
                     != str(weights.get("type", "int")).lower()):
            raise _error(name, f"input activations of {acts.get('num_bits')} bits, type {acts.get('type')!r} "
                               f"with {weights.get('type', 'int')} weights")
        if acts and fmt == "pack-quantized":
            raise _error(name, "pack-quantized weights with input activation quantization")
        if group.get("output_activations"):
            raise _error(name, "output activation quantization")
        widths.append(bits)
        asymmetric |= not symmetric
        g_idx |= str(weights.get("actorder") or "").lower() in ("group", "dynamic")
        if block is not None:
            blocks.append(tuple(block))
    if len(set(blocks)) > 1:
        raise ValueError(f"quantization_config: compressed-tensors groups with different block_structure {blocks} "
                         f"are not supported; supported: {supported_methods()}")
    return HFQuantConfig("compressed-tensors", max(widths), -1, desc_act=g_idx, zero_points=asymmetric,
                         block_size=blocks[0] if blocks else None)
