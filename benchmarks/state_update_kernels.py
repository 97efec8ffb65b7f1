"""The state layers' ops: tokenmill-cpu's C++ kernels against the portable torch ops, same inputs.

Usage (the figures in docs/benchmarks.md, "State-layer kernels"):

    python benchmarks/state_update_kernels.py --batch 1,8,32 --prompt 512 \\
        --json benchmarks/results/<date>_<machine>_state_update_kernels.json
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/state_update_kernels.py ...   # the AVX2 build on an AVX-512 machine

One layer of each kind, at the sizes of released checkpoints:

* Mamba2 (Granite 4.0-H-Tiny's mixer: 48 heads of 64 channels, one group, state 128, conv width 4, 3,328 conv
  channels, scan chunks of 256);
* gated DeltaNet (Qwen3-Next-80B-A3B's: 32 value heads, key and value heads of 128, conv width 4, 8,192 conv
  channels).

Decode (``update``, one token for each of ``--batch`` sequences, states given as ``[B, ...]`` tensors) and prefill
(``forward``, one prompt of ``--prompt`` tokens from a carried state). Prints the median milliseconds per call
(after warm-up) of the portable op (the built-in ``*_native`` method: eager torch) and of the kernel, the speed-up,
and the kernel's largest difference from the portable op relative to the largest output. ``--json`` also records
the machine (CPU model, flags, load average before and after).
"""

from __future__ import annotations

import argparse
import os
import platform
from collections.abc import Callable

import torch

from tokenmill_cpu import kernels, state_ops
from tokenmill_cpu.memory import cpu_model_name

from timing import median_ms, write_json  # benchmarks/timing.py: this script's folder is on sys.path

MAMBA2 = dict(heads=48, head_dim=64, groups=1, n=128, width=4, chunk=256)
DELTANET = dict(heads=32, key_heads=16, dk=128, dv=128, width=4)


def cases(tokens: int, dtype: torch.dtype, decode: bool) -> list[tuple[str, Callable[[bool], object]]]:
    """``(op name, run(kernel: bool))`` for each op; ``tokens``: sequences (decode) or prompt tokens (prefill)."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    m, d = MAMBA2, DELTANET
    m_conv = m["heads"] * m["head_dim"] + 2 * m["groups"] * m["n"]
    d_conv = 2 * d["key_heads"] * d["dk"] + d["heads"] * d["dv"]
    conv, ssd, delta = state_ops.CpuCausalConv1d(), state_ops.CpuMambaSSD(), state_ops.CpuGatedDeltaRule()
    out = []
    for name, dim in (("causal_conv1d (Mamba2)", m_conv), ("causal_conv1d (DeltaNet)", d_conv)):
        x, w, b = rnd(tokens, dim), rnd(dim, m["width"], scale=0.3), rnd(dim, scale=0.1)
        if decode:
            s = rnd(tokens, dim, m["width"] - 1)
            out.append((name, lambda k, x=x, s=s, w=w, b=b: (conv.update if k else conv.update_native)(x, s, w, b)))
        else:
            s = rnd(dim, m["width"] - 1)
            out.append((name, lambda k, x=x, s=s, w=w, b=b: (conv.forward if k else conv.forward_native)(x, w, b, s)))
    H, P, G, N = m["heads"], m["head_dim"], m["groups"], m["n"]
    x, dt, B, C = rnd(tokens, H, P), rnd(tokens, H), rnd(tokens, G, N), rnd(tokens, G, N)
    A, D, bias = -torch.rand(H, generator=g) - 0.5, rnd(H), rnd(H)
    if decode:
        h = rnd(tokens, H, P, N, scale=0.1)
        out.append(("mamba_ssd", lambda k: (ssd.update if k else ssd.update_native)(h, x, dt, A, B, C, D, bias)))
    else:
        h0 = torch.randn(H, P, N, generator=g) * 0.1
        out.append(("mamba_ssd", lambda k: (ssd.forward if k else ssd.forward_native)(x, dt, A, B, C, m["chunk"], D,
                                                                                      bias, h0)))
    Hv, Dk, Dv = d["heads"], d["dk"], d["dv"]
    q, kk, v = rnd(tokens, Hv, Dk), rnd(tokens, Hv, Dk), rnd(tokens, Hv, Dv)
    gate, beta = -torch.rand(tokens, Hv, generator=g), torch.rand(tokens, Hv, generator=g)
    if decode:
        S = rnd(tokens, Hv, Dk, Dv, scale=0.1)
        out.append(("gated_delta_rule",
                    lambda k: (delta.update if k else delta.update_native)(S, q, kk, v, gate, beta)))
    else:
        S0 = torch.randn(Hv, Dk, Dv, generator=g) * 0.1
        out.append(("gated_delta_rule",
                    lambda k: (delta.forward if k else delta.forward_native)(q, kk, v, gate, beta, S0)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,8,32", help="comma-separated decode batch sizes")
    p.add_argument("--prompt", default="512", help="comma-separated prefill prompt lengths ('' for none)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not kernels.load():
        raise SystemExit("tokenmill-cpu's kernels did not build; see the log above")
    load_before = os.getloadavg()
    print(f"{kernels.isa()['state_update']} kernels, {torch.get_num_threads()} threads, load {load_before}")
    print(f"{'op':26} {'phase':8} {'dtype':9} {'tokens':>6} {'torch ms':>9} {'kernel ms':>9} {'speed-up':>8} "
          f"{'rel diff':>8}")
    runs = [("decode", int(b)) for b in args.batch.split(",") if b] + [
        ("prefill", int(n)) for n in args.prompt.split(",") if n]
    rows = []
    with torch.inference_mode():
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            for phase, tokens in runs:
                for name, run in cases(tokens, dtype, phase == "decode"):
                    want, got = run(False)[0].double(), run(True)[0].double()
                    diff = float((got - want).abs().max() / want.abs().max())
                    t_torch = median_ms(lambda run=run: run(False), args.iters)
                    t_kernel = median_ms(lambda run=run: run(True), args.iters)
                    rows.append(dict(op=name, phase=phase, dtype=dtype_name, tokens=tokens,
                                     torch_ms=round(t_torch, 4), kernel_ms=round(t_kernel, 4),
                                     speedup=round(t_torch / t_kernel, 2), rel_diff=diff))
                    print(f"{name:26} {phase:8} {dtype_name:9} {tokens:6d} {t_torch:9.3f} {t_kernel:9.3f} "
                          f"{t_torch / t_kernel:7.1f}x {diff:8.1e}", flush=True)
    write_json(args.json, {
        "benchmark": "state_update_kernels", "args": vars(args), "results": rows,
        "machine": {"cpu": cpu_model_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "capability": torch.backends.cpu.get_cpu_capability(), "kernels": kernels.isa(),
                    "cpu_flags": sorted(f for f in kernels.cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx"))),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
    })


if __name__ == "__main__":
    main()
