"""Compile the Triton group-quantized matmul kernel ahead of time for GPUs this machine does not have.

Run as a script (``python -m tests.models.aot_compile_quant_kernel sm90 gfx942``) without ``TRITON_INTERPRET``,
like ``tests/attention/aot_compile_kernels.py`` (whose ``compile_kernel`` it uses): the compiler is stricter than
the interpreter (dot shapes, constexpr use). Prints one ``OK <case>`` line per compiled case; exits non-zero on
the first failure.
"""

from __future__ import annotations

import sys

from tests.attention.aot_compile_kernels import TARGETS, compile_kernel
from tokenmill.layers import triton_group_quant as ops

# label: (activation dtype, scales, zeros, mins, constexprs); every branch of the kernel on both targets, each
# case on one (compiling all of them on both took 8 s here)
CASES = {
    "int4-awq-zeros-g128-decode": ("bf16", "*fp16", "*u8", None, dict(BITS=4, GROUP_SIZE=128, BLOCK_M=16)),
    "int4-q4_0-g32-prefill": ("fp16", "*fp16", None, None, dict(BITS=4, GROUP_SIZE=32, ZERO_OFFSET=8, BLOCK_M=64)),
    "int4-q4_k-mins-g32": ("bf16", "*fp32", None, "*fp32", dict(BITS=4, GROUP_SIZE=32, BLOCK_M=32)),
    "int8-gptq-g64-fp32": ("fp32", "*bf16", None, None, dict(BITS=8, GROUP_SIZE=64, ZERO_OFFSET=128, BLOCK_M=16,
                                                             DOT_FP32=True)),
    "int8-q6_k-g16": ("bf16", "*fp32", None, None, dict(BITS=8, GROUP_SIZE=16, ZERO_OFFSET=32, BLOCK_M=16)),
}
ON_TARGET = {"sm90": ("int4-awq-zeros-g128-decode", "int4-q4_0-g32-prefill", "int8-gptq-g64-fp32"),
             "gfx942": ("int4-awq-zeros-g128-decode", "int4-q4_k-mins-g32", "int8-q6_k-g16")}


def main() -> int:
    for target_name in sys.argv[1:] or list(TARGETS):
        for label in ON_TARGET[target_name]:
            dt, scales, zeros, mins, consts = CASES[label]
            ptrs = {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "packed_ptr": "*u8", "scales_ptr": scales,
                    "zeros_ptr": zeros or scales, "mins_ptr": mins or scales}
            cfg = {"ZERO_OFFSET": 0, "HAS_ZEROS": zeros is not None, "HAS_MINS": mins is not None, "DOT_FP32": False,
                   "BLOCK_N": 64, "BLOCK_K": 64, **consts}
            asm = compile_kernel(ops._group_quant_matmul_kernel, ptrs, cfg, TARGETS[target_name])
            print(f"OK {target_name} group_quant_matmul {label} -> {asm[-1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
