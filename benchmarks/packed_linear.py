"""How much a prepacked weight would speed up the dense float32 matmuls of small CPU steps.

    python benchmarks/packed_linear.py [--rows 1,8,32,64,256] [--dtype float32] [--json FILE]

For each of SmolLM2-135M's matmul shapes (qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536, LM
head 49,152 x 576) and each row count, it times, in the same process (median of ``--iters`` after warm-up):

* ``F.linear(x, W)``: what tokenmill runs today (torch's CPU GEMM, which re-lays out the weight on every call);
* oneDNN with the weight reordered once (``torch.ops.mkldnn._reorder_linear_weight`` then
  ``torch.ops.mkldnn._linear_pointwise``): the packed copy serves any row count;
* MKL's packed GEMM (``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, float32 only), packed for
  that exact row count (at any other count ``_mkl_linear`` falls back to the unpacked weight).

The figures behind the "prepacked weights" paragraph of docs/benchmarks.md (issue 16, seventh session).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from timing import median_ms  # benchmarks/timing.py: this script's folder is on sys.path

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32,64,256")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    result: dict = {"benchmark": "packed_linear", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "dtype": args.dtype, "rows": {}}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {result['torch_cpu_capability']}, {args.dtype}")
    print(f"{'matmul':>8} {'rows':>5} {'F.linear ms':>12} {'oneDNN ms':>10} {'MKL ms':>8} {'oneDNN x':>9} {'MKL x':>6}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=dtype) * 0.02
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, dtype=dtype)
            ref = F.linear(x, w)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            tol = 1e-3 if dtype == torch.float32 else 5e-2
            if not torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol):
                raise RuntimeError(f"oneDNN packed result differs from F.linear for {name} at {rows} rows")
            base = median_ms(lambda: F.linear(x, w), args.iters)
            dnnl = median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), args.iters)
            mkl = None
            if dtype == torch.float32 and torch.backends.mkl.is_available():
                mkl_w = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
                mkl = median_ms(lambda: torch.ops.mkl._mkl_linear(x, mkl_w, w, None, rows), args.iters)
            result["rows"].setdefault(name, {})[rows] = {"f_linear_ms": base, "onednn_packed_ms": dnnl,
                                                          "mkl_packed_ms": mkl}
            mkl_s = f"{mkl:8.3f}" if mkl is not None else f"{'-':>8}"
            mkl_x = f"{base / mkl:6.2f}" if mkl is not None else f"{'-':>6}"
            print(f"{name:>8} {rows:>5} {base:12.3f} {dnnl:10.3f} {mkl_s} {base / dnnl:9.2f} {mkl_x}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
