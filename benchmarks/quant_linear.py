"""Quantized matmuls of SmolLM2-135M: tokenmill-cpu's VNNI kernels against torch's packed-weight ops.

    python benchmarks/quant_linear.py [--rows 1 4 16 32] [--layers 30] [--threads 2] [--json FILE]

For every row count M (tokens in the step): every matmul of one forward step, ``--layers`` decoder layers of
four matmuls (qkv, o, gate_up, down; distinct random weights per layer, so that they stream from memory as in
the model: 30 layers of int4 are 66 MB, more than the L3 cache) and then the LM head. Median milliseconds of
``--iters`` steps after warm-up, and the weight streaming rate (weight bytes / time). Paths: bfloat16
``F.linear`` (oneDNN), torch's int8 and int4 packed ops (``tokenmill.layers.quantization.Int8WeightOnly``,
``tokenmill_cpu.int4.Int4WeightOnly``; under ``--quantization int4`` their LM head is int8) and the kernels
(``tokenmill_cpu.quant_linear.Q8Weight`` / ``Q4Weight``, LM head ``Q8Weight``). Activations are bfloat16, as
with ``--dtype bfloat16``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
import torch.nn.functional as F

from tokenmill.layers.quantization import Int8WeightOnly, QuantizedWeight
from tokenmill_cpu import kernels
from tokenmill_cpu.int4 import Int4WeightOnly
from tokenmill_cpu.quant_linear import Q4Weight, Q8Weight

from timing import median_ms  # benchmarks/timing.py: this script's folder is on sys.path

LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)  # LM head (tied to the embedding)


class Bf16(QuantizedWeight):
    """bfloat16 ``F.linear`` behind the same interface."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        self.store(weight=weight.bfloat16())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


PATHS = {  # name: (layer class, LM head class)
    "bf16": (Bf16, Bf16),
    "torch_int8": (Int8WeightOnly, Int8WeightOnly),
    "torch_int4": (Int4WeightOnly, Int8WeightOnly),
    "q8_kernel": (Q8Weight, Q8Weight),
    "q4_kernel": (Q4Weight, Q8Weight),
}


def build(layers: int) -> dict[str, list[QuantizedWeight]]:
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.05 for _ in range(layers) for n, k in LAYER.values()]
    weights.append(torch.randn(*HEAD) * 0.05)
    return {name: [layer_cls(w) for w in weights[:-1]] + [head_cls(weights[-1])]
            for name, (layer_cls, head_cls) in PATHS.items()}


def measure(paths: dict[str, list[QuantizedWeight]], rows: int, iters: int) -> dict[str, dict[str, float]]:
    inputs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in LAYER.values()} | {HEAD[1]}}
    out = {}
    for name, quants in paths.items():
        ms = median_ms(lambda quants=quants: [q.matmul(inputs[q.in_features]) for q in quants], iters)
        nbytes = sum(q.nbytes for q in quants)
        out[name] = {"ms": round(ms, 3), "weight_MB": round(nbytes / 1e6, 1), "GB_per_s": round(nbytes / ms / 1e6, 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M has 30)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.load():
        raise SystemExit("tokenmill-cpu's kernels did not build (see the log)")
    results = {"machine": {"processor": platform.processor() or platform.machine(), "threads": args.threads,
                           "torch": torch.__version__,
                           "vnni": bool(torch.ops.tokenmill_cpu.quant_linear_has_vnni())},
               "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "layers": args.layers,
               "rows": {}}
    paths = build(args.layers)
    names = list(PATHS)
    print(f"matmuls of one step: {args.layers} layers + LM head; ms and weight GB/s")
    print(f"{'M':>3} " + " ".join(f"{n:>19}" for n in names))
    for rows in args.rows:
        entry = measure(paths, rows, args.iters)
        results["rows"][rows] = entry
        print(f"{rows:>3} " + " ".join(f"{entry[n]['ms']:>7.2f} ms {entry[n]['GB_per_s']:>5.1f} GB/s" for n in names))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
