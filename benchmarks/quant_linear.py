"""Quantized matmuls on SmolLM2-135M's shapes: tokenmill-cpu's VNNI kernels against torch's packed-weight ops.

    python benchmarks/quant_linear.py [--rows 1 4 16 32] [--threads 2] [--json FILE]

For every row count M (tokens in the step), the sum over one decoder layer's four matmuls (qkv, o, gate_up,
down) and, separately, the LM head: median milliseconds of ``--iters`` calls after warm-up, and the weight
streaming rate (weight bytes / time). Paths: bfloat16 ``F.linear`` (oneDNN), torch's int8 and int4 packed ops
(``tokenmill.layers.quantization.Int8WeightOnly``, ``tokenmill_cpu.int4.Int4WeightOnly``) and the kernels
(``tokenmill_cpu.quant_linear.Q8Weight`` / ``Q4Weight``). Activations are bfloat16, as in ``--dtype bfloat16``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from tokenmill.layers.quantization import Int8WeightOnly
from tokenmill_cpu import kernels
from tokenmill_cpu.int4 import Int4WeightOnly
from tokenmill_cpu.quant_linear import Q4Weight, Q8Weight

LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = {"lm_head": (49152, 576)}


def median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(shapes: dict[str, tuple[int, int]], rows: int, iters: int) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    paths: dict[str, list] = {"bf16": [], "torch_int8": [], "torch_int4": [], "q8_kernel": [], "q4_kernel": []}
    nbytes = {name: 0 for name in paths}
    for n, k in shapes.values():
        w = torch.randn(n, k) * 0.05
        x = torch.randn(rows, k).bfloat16()
        wb = w.bfloat16()
        quants = {"torch_int8": Int8WeightOnly(w), "torch_int4": Int4WeightOnly(w), "q8_kernel": Q8Weight(w),
                  "q4_kernel": Q4Weight(w)}
        paths["bf16"].append(lambda x=x, wb=wb: F.linear(x, wb))
        nbytes["bf16"] += wb.numel() * 2
        for name, q in quants.items():
            paths[name].append(lambda x=x, q=q: q.matmul(x))
            nbytes[name] += q.nbytes
    out = {}
    for name, fns in paths.items():
        ms = median_ms(lambda fns=fns: [f() for f in fns], iters)
        out[name] = {"ms": round(ms, 4), "weight_MB": round(nbytes[name] / 1e6, 2),
                     "GB_per_s": round(nbytes[name] / ms / 1e6, 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.load():
        raise SystemExit("tokenmill-cpu's kernels did not build (see the log)")
    results = {"machine": {"processor": platform.processor() or platform.machine(), "threads": args.threads,
                           "torch": torch.__version__,
                           "vnni": bool(torch.ops.tokenmill_cpu.quant_linear_has_vnni())},
               "rows": {}}
    print(f"{'M':>3} {'matmuls':<8} " + " ".join(f"{p:>20}" for p in ("bf16", "torch_int8", "torch_int4", "q8_kernel", "q4_kernel")))
    for rows in args.rows:
        entry = {"layer": measure(LAYER, rows, args.iters), "lm_head": measure(HEAD, rows, max(10, args.iters // 5))}
        results["rows"][rows] = entry
        for part, res in entry.items():
            cells = " ".join(f"{r['ms']:>8.3f} ms {r['GB_per_s']:>5.1f} GB/s" for r in res.values())
            print(f"{rows:>3} {part:<8} {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
