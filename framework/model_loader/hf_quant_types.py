"""The loader's view of a Hugging Face checkpoint's ``quantization_config``: the supported methods and the fields
read from it (:class:`HFQuantConfig`). Parsing is in ``tokenmill.model_loader.hf_quant_config``."""

from __future__ import annotations

from dataclasses import dataclass

# method -> supported bit widths
SUPPORTED_METHODS: dict[str, tuple[int, ...]] = {"awq": (4,), "gptq": (4, 8), "compressed-tensors": (4, 8),
                                                 "fp8": (8,)}
# what the error messages list after each method's bit widths
METHOD_NOTES = {"compressed-tensors": "pack-quantized int4/int8, int-quantized int8 (W8A8), float-quantized fp8",
                "fp8": "per-tensor or block-wise scales"}


@dataclass(frozen=True)
class HFQuantConfig:
    """The fields of ``quantization_config`` the loader uses.

    Attributes:
        method: ``"awq"``, ``"gptq"``, ``"compressed-tensors"`` or ``"fp8"``.
        bits: bits per weight code (AWQ 4; GPTQ 4 or 8; compressed-tensors the widest scheme's, a module's own
            width follows from its tensors; FP8 8).
        group_size: input channels sharing one scale and zero point; ``-1`` in the file (one group per row)
            is kept as ``-1`` and resolved per layer.
        desc_act: activation order (GPTQ's ``desc_act``, compressed-tensors' ``actorder: group``): the
            checkpoint's ``g_idx`` (``weight_g_idx``) assigns each input channel its group.
        zero_offset: added to a stored zero point to get the one the format subtracts: 1 for GPTQ's
            ``checkpoint_format`` ``"gptq"`` (v1, which stores ``z - 1``), 0 for ``"gptq_v2"`` and AWQ.
        zero_points: compressed-tensors: some module has a ``weight_zero_point`` (an asymmetric scheme), so a
            module's tensors are complete only with it (else at the end of the checkpoint).
        block_size: FP8 ``weight_block_size`` (or compressed-tensors' ``block_structure``) ``(rows, columns)``:
            one scale per block of the weight, the last blocks of a row or column cut short; ``None``: the
            scale's shape divides the weight's.
    """

    method: str
    bits: int
    group_size: int
    desc_act: bool = False
    zero_offset: int = 0
    zero_points: bool = False
    block_size: tuple[int, int] | None = None


def supported_methods() -> str:
    """The supported methods as error messages list them."""
    return ", ".join(f"{m} ({'/'.join(map(str, b))}-bit{': ' + METHOD_NOTES[m] if m in METHOD_NOTES else ''})"
                     for m, b in SUPPORTED_METHODS.items())
