"""Compile the Triton paged-attention kernels ahead of time for GPUs this machine does not have.

Run as a script (``python -m tests.attention.aot_compile_kernels``) without ``TRITON_INTERPRET``: the whole
compiler pipeline (Triton IR -> LLVM -> PTX/cubin for NVIDIA Hopper sm_90, AMDGCN/hsaco for MI300 gfx942)
runs on CPU, which catches what the interpreter lets through (e.g. loop-carried constexprs, dot shapes).
Prints one ``OK <case>`` line per compiled case; exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tokenmill.attention.ops import triton_paged_attention as ops  # noqa: E402

TARGETS = {"sm90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64)}


def compile_kernel(fn: triton.JITFunction, ptr_types: dict[str, str], consts: dict[str, object], target: GPUTarget) -> list[str]:
    """Compile ``fn``; every argument not in ``ptr_types`` or ``consts`` is an int32 scalar."""
    names = fn.arg_names
    sig = {n: ptr_types.get(n, "constexpr" if n in consts else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    return list(triton.compile(src, target=target, options={"num_warps": 4}).asm)


QUANT_CACHES = {"*i8": 1, "*fp8e4nv": 2, "*fp8e5": 2}  # Triton pointer type of each quantized cache -> QUANT


def main() -> int:
    for target_name in sys.argv[1:] or list(TARGETS):
        target = TARGETS[target_name]
        for dt in ("bf16", "fp16", "fp32"):
            if target_name == "gfx942" and dt != "bf16":
                continue
            ptrs = {p: f"*{dt}" for p in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
            ptrs.update(block_table_ptr="*i32", query_start_loc_ptr="*i32", seq_lens_ptr="*i32", scale_log2="fp32",
                        soft_cap="fp32", k_scale_ptr="*fp32", v_scale_ptr="*fp32")
            for label, cfg in {
                "prefill-gqa4-D128": dict(HEAD_SIZE=128, BLOCK_D=128, GROUP=4, GROUP_P2=4, BLOCK_Q=16, BLOCK_M=64,
                                          BLOCK_N=32, KV_BLOCK_SIZE=16),
                "decode-gqa3-D64-bs1": dict(HEAD_SIZE=64, BLOCK_D=64, GROUP=3, GROUP_P2=4, BLOCK_Q=4, BLOCK_M=16,
                                            BLOCK_N=64, KV_BLOCK_SIZE=1),
                "prefill-window-softcap-D256": dict(HEAD_SIZE=256, BLOCK_D=256, GROUP=2, GROUP_P2=2, BLOCK_Q=32,
                                                    BLOCK_M=64, BLOCK_N=32, KV_BLOCK_SIZE=16, SLIDING_WINDOW=4096,
                                                    SOFT_CAP=True),
                "encoder-gqa2-D64": dict(HEAD_SIZE=64, BLOCK_D=64, GROUP=2, GROUP_P2=2, BLOCK_Q=32, BLOCK_M=64,
                                         BLOCK_N=64, KV_BLOCK_SIZE=1, CAUSAL=False),
            }.items():
                if label.startswith("encoder") and dt != "bf16":  # the mask differs, not the dtype handling
                    continue
                cfg.setdefault("SLIDING_WINDOW", 0)
                cfg.setdefault("SOFT_CAP", False)
                cfg.setdefault("CAUSAL", True)
                cfg["DOT_FP32"] = dt == "fp32"
                cfg.update(QUANT=0, SCALE_COL=0)
                asm = compile_kernel(ops._paged_attention_kernel, ptrs, cfg, target)
                print(f"OK {target_name} paged_attention {dt} {label} -> {asm[-1]}", flush=True)
                if dt != "bf16" or label != "decode-gqa3-D64-bs1":
                    continue
                # Quantized caches (--kv-cache-dtype): int8 rows of 68 bytes (scale at float 16), fp8 e4m3 / e5m2.
                for cache_type, quant in QUANT_CACHES.items():
                    qptrs = dict(ptrs, k_cache_ptr=cache_type, v_cache_ptr=cache_type)
                    asm = compile_kernel(ops._paged_attention_kernel, qptrs, dict(cfg, QUANT=quant, SCALE_COL=16),
                                         target)
                    print(f"OK {target_name} paged_attention bf16 {label} over {cache_type} -> {asm[-1]}", flush=True)
        ptrs = {p: "*bf16" for p in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")}
        ptrs.update(slot_mapping_ptr="*i64", k_scale_ptr="*fp32", v_scale_ptr="*fp32")
        cfg = dict(NUM_KV_HEADS=8, HEAD_SIZE=128, BLOCK_H=8, BLOCK_D=128, KV_BLOCK_SIZE=16, QUANT=0, SCALE_COL=0,
                   FP8_MAX=0.0, **ops._FP8_ROUNDING[torch.float8_e4m3fn])
        asm = compile_kernel(ops._reshape_and_cache_kernel, ptrs, cfg, target)
        print(f"OK {target_name} reshape_and_cache bf16 -> {asm[-1]}", flush=True)
        for cache_type, quant in QUANT_CACHES.items():
            dtype = {"*i8": torch.int8, "*fp8e4nv": torch.float8_e4m3fn, "*fp8e5": torch.float8_e5m2}[cache_type]
            qcfg = dict(cfg, QUANT=quant, SCALE_COL=32, FP8_MAX=ops.FP8_MAX.get(dtype, 0.0),
                        **ops._FP8_ROUNDING.get(dtype, {}))
            qptrs = dict(ptrs, k_cache_ptr=cache_type, v_cache_ptr=cache_type)
            asm = compile_kernel(ops._reshape_and_cache_kernel, qptrs, qcfg, target)
            print(f"OK {target_name} reshape_and_cache bf16 into {cache_type} -> {asm[-1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
