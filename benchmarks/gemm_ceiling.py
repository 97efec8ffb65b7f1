"""The matmul ceiling of ``tokenmill bench throughput`` on this machine: measured GEMM rates at the run's shapes.

    python benchmarks/gemm_ceiling.py [--num-prompts 256 --input-len 128 --output-len 128] [--json FILE]

For SmolLM2-135M's matmuls (per layer qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536; 30
layers; LM head 49,152 x 576) it times ``F.linear``, oneDNN on prepacked weights
(``torch.ops.mkldnn._linear_pointwise``, what tokenmill-cpu's bfloat16 linear layers run) and, for float32,
tokenmill-cpu's panel kernel (``torch.ops.tokenmill_cpu.dense_gemm``, what its float32 layers run at up to 256
rows, and above where it measures faster than ``F.linear``), and takes the fastest, at the row counts a throughput
run has: prefill steps of ``--prefill-rows`` tokens (the scheduler's token budget) and decode steps of
``--num-prompts`` running requests. Each row count's GFLOP/s is 2 M N K summed over one step's matmuls divided
by the median time of that step (distinct weights per layer, so they stream from memory as in the model).

The ceiling is what an engine doing nothing but these matmuls at these rates could reach: the run's prompt
tokens cost every layer matmul (the LM head only for the last token of each prompt), its output tokens every
layer matmul plus the LM head, so ``ceiling tok/s = N x O / (prefill matmul time + decode matmul time)``.
Attention, norms, sampling and the engine come on top. With ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2`` an AVX-512 machine gives the figures of its AVX2 code paths.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

from timing import median_ms, write_json  # benchmarks/timing.py: this script's folder is on sys.path

LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K) of qkv, o, gate_up, down
HEAD = (49152, 576)
NUM_LAYERS = 30


def step_ms(rows: int, dtype: torch.dtype, layers: int, iters: int, head: bool,
            packed: bool | str) -> tuple[float, float]:
    """Median ms of one step's matmuls at ``rows`` rows (``packed``: on oneDNN-prepacked weights; ``"panel"``: on
    tokenmill-cpu's panel kernel), and its GFLOP count. Raises ``RuntimeError`` where oneDNN cannot pack
    ``dtype``."""
    weights = [torch.randn(n, k, dtype=dtype) * 0.02 for _ in range(layers) for n, k in LAYER]
    if head:
        weights.append(torch.randn(*HEAD, dtype=dtype) * 0.02)
    xs = {k: torch.randn(rows, k, dtype=dtype) for k in {k for _, k in LAYER} | {HEAD[1]}}
    flops = sum(2.0 * rows * w.shape[0] * w.shape[1] for w in weights)
    if packed == "panel":
        from tokenmill_cpu import dense_linear

        width = int(torch.ops.tokenmill_cpu.dense_gemm_panel())
        panels = [(dense_linear.pack_panels(w, width), w.shape[1], w.shape[0]) for w in weights]

        def run_panels() -> None:
            for p, k, n in panels:
                torch.ops.tokenmill_cpu.dense_gemm(xs[k], p, n)

        return median_ms(run_panels, iters=iters, warmup=2), flops / 1e9
    prepacked = [(torch.ops.mkldnn._reorder_linear_weight(w, None), w.shape[1]) for w in weights] if packed else []

    def run() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    def run_packed() -> None:
        for p, k in prepacked:
            torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")

    return median_ms(run_packed if packed else run, iters=iters, warmup=2), flops / 1e9


def best_step_ms(rows: int, dtype: torch.dtype, layers: int, iters: int, head: bool) -> tuple[float, float, dict]:
    """The fastest of ``F.linear``, prepacked oneDNN and (float32, where tokenmill-cpu's kernels build) the panel
    kernel at ``rows`` rows: (ms, GFLOP, ms of each path)."""
    plain_ms, gflop = step_ms(rows, dtype, layers, iters, head, packed=False)
    each = {"f_linear_ms": plain_ms, "prepacked_ms": None, "panel_ms": None}
    try:
        each["prepacked_ms"], _ = step_ms(rows, dtype, layers, iters, head, packed=True)
    except RuntimeError:  # e.g. bfloat16 where oneDNN lacks AVX-512
        pass
    if dtype == torch.float32:
        from tokenmill_cpu import kernels

        if kernels.load():
            each["panel_ms"], _ = step_ms(rows, dtype, layers, iters, head, packed="panel")
    return min(v for v in each.values() if v is not None), gflop, each


def _pair(each: dict) -> str:
    paths = ("f_linear_ms", "prepacked_ms", "panel_ms")
    return " / ".join(f"{each[k]:.1f}" if each[k] is not None else "-" for k in paths)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefill-rows", type=int, default=2048, help="tokens per prefill step (token budget)")
    parser.add_argument("--layers", type=int, default=NUM_LAYERS)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    n, i, o = args.num_prompts, args.input_len, args.output_len
    scale = NUM_LAYERS / args.layers
    result: dict = {"benchmark": "gemm_ceiling", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "command": " ".join(["python", *sys.argv]), "cpu": platform.processor(),
                    "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "dtypes": {}}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, capability "
          f"{result['torch_cpu_capability']}, ONEDNN_MAX_CPU_ISA={result['onednn_max_cpu_isa']}")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        pre_ms, pre_gf, pre_each = best_step_ms(args.prefill_rows, dtype, args.layers, args.iters, head=False)
        dec_ms, dec_gf, dec_each = best_step_ms(n, dtype, args.layers, args.iters, head=True)
        pre_rate, dec_rate = pre_gf / pre_ms * 1e3, dec_gf / dec_ms * 1e3
        # the whole run: prompt tokens through every layer matmul, output tokens through layers and head
        layer_gflop_per_token = sum(2.0 * a * b for a, b in LAYER) * NUM_LAYERS / 1e9
        head_gflop_per_token = 2.0 * HEAD[0] * HEAD[1] / 1e9
        prefill_s = n * i * layer_gflop_per_token / pre_rate + n * head_gflop_per_token / dec_rate
        decode_s = n * (o - 1) * (layer_gflop_per_token + head_gflop_per_token) / dec_rate
        ceiling = n * o / (prefill_s + decode_s)
        result["dtypes"][name] = {
            "prefill_rows": args.prefill_rows, "prefill_step_ms": pre_ms * scale, "prefill_gflops": pre_rate,
            "decode_rows": n, "decode_step_ms": dec_ms * scale if args.layers == NUM_LAYERS else None,
            "decode_gflops": dec_rate, "run_prefill_matmul_s": prefill_s, "run_decode_matmul_s": decode_s,
            "ceiling_output_tokens_per_s": ceiling, "prefill_paths_ms": pre_each, "decode_paths_ms": dec_each,
        }
        print(f"{name:>9}: prefill M={args.prefill_rows} {pre_rate:7.1f} GFLOP/s, decode M={n} {dec_rate:7.1f} "
              f"GFLOP/s -> run matmuls {prefill_s:.1f} s + {decode_s:.1f} s, ceiling {ceiling:.0f} output tok/s "
              f"(80%: {0.8 * ceiling:.0f}); F.linear / prepacked / panel step ms: prefill {_pair(pre_each)}, decode "
              f"{_pair(dec_each)}")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
