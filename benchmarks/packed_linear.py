"""How much prepacked weights speed up the dense matmuls of one decoder step on a CPU (tokenmill_cpu.dense_linear).

    python benchmarks/packed_linear.py [--rows 1,4,32,256] [--dtype float32|bfloat16] [--json FILE]

For SmolLM2-135M's matmul shapes (per layer qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536,
with distinct weights for each of the 30 layers so that they stream from memory as in the model, plus the LM head
49,152 x 576) and each row count, it times one step's matmuls (milliseconds, median of ``--iters`` after
warm-up) up to four ways, in the same process:

* ``F.linear(x, W)``: torch's CPU GEMM, which re-lays out the weight on every call;
* oneDNN with each weight reordered once (``torch.ops.mkldnn._reorder_linear_weight`` /
  ``torch.ops.mkldnn._linear_pointwise``);
* float32 only: MKL's packed GEMM with each weight packed once for 32 rows and told the step's row count
  (``torch.ops.mkl._mkl_reorder_linear_weight`` / ``torch.ops.mkl._mkl_linear``), what tokenmill-cpu runs where
  its panel kernel is not built; every product is checked against ``F.linear`` first;
* float32 only: tokenmill-cpu's panel kernel (``torch.ops.tokenmill_cpu.dense_gemm`` on
  ``tokenmill_cpu.dense_linear.pack_panels``), what tokenmill-cpu runs now at 1 to 256 rows; built for the
  capability torch reports, so ``ATEN_CPU_CAPABILITY=avx2`` times its AVX2 build.
* bfloat16, where tokenmill-cpu's kernels have their AVX-512 BF16 build: its bfloat16 panel kernel
  (``torch.ops.tokenmill_cpu.dense_gemm_bf16`` on ``tokenmill_cpu.dense_linear.pack_panels_bf16``), what
  tokenmill-cpu runs at 1 to 4 rows (oneDNN above).

The figures behind the choice of path in ``tokenmill_cpu/dense_linear.py`` (docs/benchmarks.md, "Dense
matmuls"). With ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` an AVX-512 machine
gives the AVX2 code paths.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

from timing import median_ms, write_json  # benchmarks/timing.py: this script's folder is on sys.path

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
NUM_LAYERS = 30
MKL_PACK_ROWS = 32


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,32,256")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    use_mkl = dtype == torch.float32 and torch.backends.mkl.is_available()
    from tokenmill_cpu import dense_linear, kernels

    use_panel = kernels.load()
    if dtype == torch.float32:
        width = int(torch.ops.tokenmill_cpu.dense_gemm_panel()) if use_panel else 0
        pack, gemm, isa = (lambda w: dense_linear.pack_panels(w, width)), "dense_gemm", "dense_gemm_isa"
    else:  # the bfloat16 panel kernel, only where it has its AVX-512 BF16 loops
        use_panel = use_panel and str(torch.ops.tokenmill_cpu.dense_gemm_bf16_isa()) == "avx512_bf16"
        pack, gemm, isa = dense_linear.pack_panels_bf16, "dense_gemm_bf16", "dense_gemm_bf16_isa"
    result: dict = {"benchmark": "packed_linear", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
                    "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS"), "dtype": args.dtype,
                    "panel_kernel": gemm, "panel_isa": str(getattr(torch.ops.tokenmill_cpu, isa)()) if use_panel else None,
                    "step_ms": {}}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {result['torch_cpu_capability']}, {args.dtype}")
    weights = {}
    for name, (n, k) in SHAPES.items():
        ws = [(torch.randn(n, k) * 0.02).to(dtype) for _ in range(1 if name == "lm_head" else NUM_LAYERS)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, MKL_PACK_ROWS) for w in ws] if use_mkl else []
        panels = [pack(w) for w in ws] if use_panel else []
        weights[name] = (ws, onednn, mkl, panels)
    print(f"{'rows':>5} {'F.linear ms':>12} {'oneDNN ms':>10} {'MKL ms':>8} {'panel ms':>9}")
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    for rows in (int(r) for r in args.rows.split(",")):
        total = {"f_linear": 0.0, "onednn_packed": 0.0, "mkl_packed": 0.0 if use_mkl else None,
                 "panel": 0.0 if use_panel else None}
        for name, (ws, onednn, mkl, panels) in weights.items():
            x = torch.randn(rows, SHAPES[name][1]).to(dtype)
            ref = F.linear(x, ws[0])
            checks = [torch.ops.mkldnn._linear_pointwise(x, onednn[0], None, "none", [], "")]
            checks += [torch.ops.mkl._mkl_linear(x, mkl[0], ws[0], None, rows)] if use_mkl else []
            n = SHAPES[name][0]
            checks += [getattr(torch.ops.tokenmill_cpu, gemm)(x, panels[0], n)] if use_panel else []
            for got in checks:
                if not torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol):
                    raise RuntimeError(f"a packed product differs from F.linear for {name} at {rows} rows")
            total["f_linear"] += median_ms(lambda: [F.linear(x, w) for w in ws], args.iters)
            total["onednn_packed"] += median_ms(
                lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in onednn], args.iters)
            if use_mkl:
                total["mkl_packed"] += median_ms(
                    lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, rows) for p, w in zip(mkl, ws)], args.iters)
            if use_panel:
                total["panel"] += median_ms(
                    lambda: [getattr(torch.ops.tokenmill_cpu, gemm)(x, p, n) for p in panels], args.iters)
        result["step_ms"][rows] = total
        mkl_s = f"{total['mkl_packed']:8.1f}" if use_mkl else f"{'-':>8}"
        panel_s = f"{total['panel']:9.1f}" if use_panel else f"{'-':>9}"
        print(f"{rows:>5} {total['f_linear']:12.1f} {total['onednn_packed']:10.1f} {mkl_s} {panel_s}", flush=True)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
