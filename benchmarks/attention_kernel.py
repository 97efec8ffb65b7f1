"""Decode attention over the paged KV cache: tokenmill-cpu's C++ kernel against the torch paths, same inputs.

Usage (the figures in docs/benchmarks.md, "Decode attention kernel"):

    python benchmarks/attention_kernel.py --batch 256 --context 192
    python benchmarks/attention_kernel.py --dtype float32 --cache-dtype bfloat16 [--no-huge-pages]

One layer of SmolLM2-135M's shape by default (9 query heads, 3 KV heads, head size 64, bfloat16, 16-token
blocks in random order). Prints the median time per call (milliseconds, after warm-up) of: the torch backend's
eager decode path (gather the blocks, two batched matmuls), the same code under torch.compile (the fused loops
Inductor generates), and the C++ kernel, plus the memory floor (keys and values read once at the measured
streaming bandwidth of this machine) and each path's error against the same attention in float64
(``max |out - ref| / max |ref|``).

``--cache-dtype`` puts the cache in another dtype than the queries (``--kv-cache-dtype``; the quantized ones,
``int8``, ``fp8_e4m3``, ``fp8_e5m2``, under ``--dtype float32``). The cache is allocated
as the engine allocates it on CPU (``tokenmill_cpu.memory.lazily_zeroed_tensor``: transparent huge pages);
``--no-huge-pages`` puts it in an ordinary torch tensor (4 KiB pages where THP is only on request).
"""

from __future__ import annotations

import argparse

import torch

from tokenmill.attention.backends.torch_paged import TorchPagedAttentionImpl
from tokenmill.attention.kv_cache_quant import dequantize_kv, kv_cache_row_size, quantize_kv
from tokenmill.dtypes import kv_cache_dtype_to_torch
from tokenmill_cpu import kernels
from tokenmill_cpu.platform import separate_inductor_cache

from timing import median_ms  # benchmarks/timing.py: this script's folder is on sys.path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256, help="requests, one query token each")
    p.add_argument("--context", type=int, default=192, help="tokens of context per request")
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", help="query (model) dtype")
    p.add_argument("--cache-dtype", default=None, help="KV cache dtype (default: --dtype)")
    p.add_argument("--no-huge-pages", action="store_true", help="cache in an ordinary tensor, not the engine's mapping")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--blocks", default="random", choices=["random", "engine", "shared", "contiguous"],
                   help="block table: random order; 'engine': as the block pool hands them out in a throughput "
                        "run (each prompt's --prompt-blocks consecutive, the later ones one per request in turn); "
                        "'shared': every request on the same blocks (they stay in cache: the kernel's own work); "
                        "'contiguous': each request's blocks one after another (the longest runs of memory)")
    p.add_argument("--prompt-blocks", type=int, default=8, help="with --blocks engine: consecutive blocks per prompt")
    p.add_argument("--kernel-only", action="store_true", help="time only the C++ kernel")
    p.add_argument("--layers", type=int, default=1,
                   help="distinct caches per call (30: a SmolLM2-135M step's worth, streaming from memory as in "
                        "the engine; 1 may stay in the last-level cache)")
    args = p.parse_args()
    separate_inductor_cache()  # under ATEN_CPU_CAPABILITY: not the default level's compiled loops
    if not kernels.load():
        raise SystemExit("tokenmill-cpu's kernel did not build; see the log above")
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    b, bs, d = args.batch, args.block_size, args.head_size
    nb = -(-args.context // bs)
    num_blocks = b * nb + 1
    cache_dtype = kv_cache_dtype_to_torch(args.cache_dtype or args.dtype)
    row = kv_cache_row_size(d, cache_dtype)  # an int8 row carries its scale
    shape = (2, args.num_kv_heads, num_blocks, bs, row)
    values = quantize_kv(torch.randn(*shape[:-1], d, generator=g), cache_dtype)
    caches = []
    for _ in range(args.layers):
        if args.no_huge_pages:
            caches.append(values.clone())
        else:
            from tokenmill_cpu.memory import lazily_zeroed_tensor

            caches.append(lazily_zeroed_tensor(shape, cache_dtype).copy_(values))
    del values
    cache = caches[0]
    table = block_table(args.blocks, b, nb, min(args.prompt_blocks, nb), num_blocks, g)
    seq_lens = torch.full((b,), args.context, dtype=torch.int32)
    q = torch.randn(b, args.num_heads, d, generator=g).to(dtype)
    impl = TorchPagedAttentionImpl(args.num_heads, d, d**-0.5, args.num_kv_heads)
    compiled = torch.compile(impl.forward_decode, dynamic=True)

    with torch.inference_mode():
        ref = impl.forward_decode(q.double(), dequantize_kv(cache, d, torch.float64), table, seq_lens, bs)
        results = {  # each returns the first layer's output
            "torch eager (gather + bmm)": (lambda: [impl.forward_decode(q, c, table, seq_lens, bs) for c in caches][0]),
            "torch.compile (Inductor loops)": (lambda: [compiled(q, c, table, seq_lens, bs) for c in caches][0]),
            "tokenmill-cpu C++ kernel": (lambda: [kernels.paged_decode(q, c, table, seq_lens, d**-0.5)
                                                  for c in caches][0]),
        }
        if args.kernel_only:
            results = {k: v for k, v in results.items() if "C++" in k}
        if cache_dtype != dtype:  # the engine's compiled decode graphs call the C++ kernel; no second trace here
            results.pop("torch.compile (Inductor loops)", None)
        # float32: torch's bfloat16 sum is compute-bound here (17 vs 27 GB/s) and would understate the floor
        big = torch.empty(1 << 27, dtype=torch.float32).fill_(1)
        bw = big.numel() * big.element_size() / (median_ms(big.sum, 5) / 1000)
        kv_bytes = 2 * b * args.context * args.num_kv_heads * row * cache.element_size() * args.layers
        print(f"{b} requests x {args.context} tokens, {args.num_heads}/{args.num_kv_heads} heads of {d}, {args.dtype} "
              f"queries, {cache_dtype} cache ({'ordinary pages' if args.no_huge_pages else 'huge pages asked'}), "
              f"{torch.get_num_threads()} threads, {args.layers} layer(s) per call, {args.blocks} blocks")
        print(f"{'path':34s} {'ms/call':>8s} {'rel. error':>11s}")
        for name, fn in results.items():
            err = ((fn().double() - ref).abs().max() / ref.abs().max()).item()
            print(f"{name:34s} {median_ms(fn, args.iters):8.2f} {err:11.2e}")
        print(f"{'memory floor (K+V once)':34s} {kv_bytes / bw * 1000:8.2f}   ({kv_bytes / 1e6:.1f} MB at {bw / 1e9:.1f} GB/s)")


def block_table(kind: str, b: int, nb: int, prompt_blocks: int, num_blocks: int, g: torch.Generator) -> torch.Tensor:
    """``[b, nb]`` int32 block ids in 1 .. num_blocks - 1 (see ``--blocks``)."""
    if kind == "random":
        return (torch.randperm(num_blocks - 1, generator=g)[: b * nb] + 1).view(b, nb).int()
    if kind == "contiguous":
        return (torch.arange(b * nb, dtype=torch.int32) + 1).view(b, nb)
    if kind == "shared":
        return torch.arange(1, nb + 1, dtype=torch.int32).expand(b, nb).contiguous()
    prompt = torch.arange(b * prompt_blocks, dtype=torch.int32).view(b, prompt_blocks) + 1
    later = torch.arange(b * (nb - prompt_blocks), dtype=torch.int32).view(nb - prompt_blocks, b).T
    later = later + 1 + b * prompt_blocks  # block j of the decode phase: one per request in turn
    return torch.cat([prompt, later], dim=1).contiguous()


if __name__ == "__main__":
    main()
