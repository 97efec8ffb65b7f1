"""The state layers' decode step: tokenmill-cpu's C++ kernels against the portable torch ops, same inputs.

Usage (the figures in docs/benchmarks.md, "State-layer decode kernels"):

    python benchmarks/state_update_kernels.py --batch 1,8,32 --json benchmarks/results/<date>_<machine>_state_update.json
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/state_update_kernels.py ...   # the AVX2 build on an AVX-512 machine

One layer of each kind, at the sizes of released checkpoints by default:

* Mamba2 (Granite 4.0-H-Tiny's mixer: 48 heads of 64 channels, one group, state 128, conv width 4):
  ``causal_conv1d`` update over its 3,328 conv channels, then ``mamba_ssd`` update;
* gated DeltaNet (Qwen3-Next-80B-A3B's: 32 value heads, key and value heads of 128, conv width 4):
  ``causal_conv1d`` update over its 8,192 conv channels, then ``gated_delta_rule`` update.

Prints, for each batch size (sequences decoding one token each) and dtype, the median milliseconds per call
(after warm-up) of the portable op (``update_native``: eager torch) and of the kernel, each call reading its state
slots from and writing them back to a state cache of ``--slots`` slots as the mixers do (``cache[slots]`` and
``cache[slots] = new``), the speed-up, and the kernel's largest difference from the portable op relative to the
largest output. ``--json`` also records the machine (CPU model, flags, load average).
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

from tokenmill_cpu import kernels, state_ops
from tokenmill_cpu.memory import cpu_model_name

from timing import median_ms, write_json  # benchmarks/timing.py: this script's folder is on sys.path


def mamba2_case(batch: int, slots: int, dtype: torch.dtype, g: torch.Generator):
    """(name, portable step, kernel step) of one Mamba2 layer's conv + SSM update."""
    heads, head_dim, groups, n, width = 48, 64, 1, 128, 4
    conv_dim = heads * head_dim + 2 * groups * n
    conv_cache = torch.randn(slots, conv_dim, width - 1, generator=g).to(dtype)
    ssm_cache = (torch.randn(slots, heads, head_dim, n, generator=g) * 0.1).to(dtype)
    idx = torch.randperm(slots, generator=g)[:batch]
    xbc = torch.randn(batch, conv_dim, generator=g).to(dtype)
    w, bias = (torch.randn(conv_dim, width, generator=g) * 0.3).to(dtype), torch.randn(conv_dim, generator=g).to(dtype)
    dt, A = torch.randn(batch, heads, generator=g).to(dtype), -torch.rand(heads, generator=g) - 0.5
    D, dt_bias = torch.randn(heads, generator=g).to(dtype), torch.randn(heads, generator=g).to(dtype)
    conv, ssd = state_ops.CpuCausalConv1d(), state_ops.CpuMambaSSD()  # update_native: the portable op

    def step(native: bool):
        def run():
            update_conv = conv.update_native if native else conv.update
            update_ssd = ssd.update_native if native else ssd.update
            out, new = update_conv(xbc, conv_cache[idx], w, bias, "silu")
            conv_cache[idx] = new.to(dtype)
            x, B, C = out.split([heads * head_dim, groups * n, groups * n], dim=-1)
            y, state = update_ssd(ssm_cache[idx], x.reshape(batch, heads, head_dim), dt, A,
                                  B.reshape(batch, groups, n), C.reshape(batch, groups, n), D, dt_bias)
            ssm_cache[idx] = state.to(dtype)
            return y
        return run

    return "mamba2", step(True), step(False)


def delta_case(batch: int, slots: int, dtype: torch.dtype, g: torch.Generator):
    """(name, portable step, kernel step) of one gated DeltaNet layer's conv + delta-rule update."""
    hv, hk, dk, dv, width = 32, 16, 128, 128, 4
    conv_dim = 2 * hk * dk + hv * dv
    conv_cache = torch.randn(slots, conv_dim, width - 1, generator=g).to(dtype)
    rec_cache = (torch.randn(slots, hv, dk, dv, generator=g) * 0.1).to(dtype)
    idx = torch.randperm(slots, generator=g)[:batch]
    mixed = torch.randn(batch, conv_dim, generator=g).to(dtype)
    w = (torch.randn(conv_dim, width, generator=g) * 0.3).to(dtype)
    gate, beta = -torch.rand(batch, hv, generator=g), torch.rand(batch, hv, generator=g)
    conv, delta = state_ops.CpuCausalConv1d(), state_ops.CpuGatedDeltaRule()  # update_native: the portable op

    def step(native: bool):
        def run():
            update_conv = conv.update_native if native else conv.update
            update_delta = delta.update_native if native else delta.update
            out, new = update_conv(mixed, conv_cache[idx], w, None, "silu")
            conv_cache[idx] = new.to(dtype)
            q, k, v = out.split([hk * dk, hk * dk, hv * dv], dim=-1)
            q = q.reshape(batch, hk, dk).repeat_interleave(hv // hk, dim=1)
            k = k.reshape(batch, hk, dk).repeat_interleave(hv // hk, dim=1)
            o, state = update_delta(rec_cache[idx], q, k, v.reshape(batch, hv, dv), gate, beta)
            rec_cache[idx] = state.to(dtype)
            return o
        return run

    return "gated_deltanet", step(True), step(False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--slots", type=int, default=64, help="state slots in each cache (>= the largest batch)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not kernels.load():
        raise SystemExit("tokenmill-cpu's kernels did not build; see the log above")
    rows = []
    load_before = os.getloadavg()
    print(f"{kernels.isa()['state_update']} kernels, {torch.get_num_threads()} threads, load {os.getloadavg()}")
    print(f"{'layer':15} {'dtype':9} {'batch':>5} {'torch ms':>9} {'kernel ms':>9} {'speed-up':>8} {'rel diff':>9}")
    with torch.inference_mode():
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            for batch in (int(b) for b in args.batch.split(",")):
                for make in (mamba2_case, delta_case):
                    # the same seed for both paths: identical caches and inputs
                    name, native, kernel = make(batch, max(args.slots, batch), dtype, torch.Generator().manual_seed(0))
                    want = native().double()
                    _, _, kernel_again = make(batch, max(args.slots, batch), dtype, torch.Generator().manual_seed(0))
                    got = kernel_again().double()
                    diff = float((got - want).abs().max() / want.abs().max())
                    t_native, t_kernel = median_ms(native, args.iters), median_ms(kernel, args.iters)
                    rows.append(dict(layer=name, dtype=dtype_name, batch=batch, torch_ms=round(t_native, 4),
                                     kernel_ms=round(t_kernel, 4), speedup=round(t_native / t_kernel, 2),
                                     rel_diff=diff))
                    print(f"{name:15} {dtype_name:9} {batch:5d} {t_native:9.3f} {t_kernel:9.3f} "
                          f"{t_native / t_kernel:7.1f}x {diff:9.1e}")
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
