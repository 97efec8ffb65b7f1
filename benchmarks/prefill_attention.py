"""A prefill step's attention work on the CPU plugin: one kernel call for all fresh prompts against one per prompt,
and the C++ cache write against torch's indexed assignment, same inputs, same process.

    python benchmarks/prefill_attention.py [--prompts 15 --prompt-len 128 --decodes 48] [--json FILE]
    python benchmarks/prefill_attention.py --lengths 1024,32x32   # one long prompt among 32 short ones

One layer of SmolLM2-135M's shape (9 query heads, 3 KV heads, head size 64, float32 unless ``--dtype``), with
q, k and v as views of one fused projection as the model gives them. Prints the median milliseconds per layer
(after warm-up) of:

* prompts one by one: ``tokenmill_cpu.kernels.prefill_attention`` once per prompt (the baseline for one call
  per step);
* prompts in one call: ``tokenmill_cpu.kernels.prefill_attention_varlen`` (what it runs now);
* torch's ``scaled_dot_product_attention`` (``is_causal``, ``enable_gqa``) once per prompt: the torch op the
  kernel must beat (and the arithmetic rate of each: causal attention is ``4 * Hq * D * L * (L + 1) / 2`` FLOPs
  per prompt of ``L`` tokens);
* with ``--prefix P``: each prompt as a chunk after a cached prefix of ``P`` tokens, its keys and values
  head-major (``[Hkv, P + L, D]`` contiguous, seen as ``[P + L, Hkv, D]``) as the backend gathers them: ``tokenmill_cpu.kernels.prefill_attention``
  once per prompt (``python benchmarks/prefill_attention.py --lengths 1952x1 --prefix 2048``: the second step of
  a 4,000-token prompt at the default 2,048-token step budget);
* the step's cache write (``--prompts x --prompt-len + --decodes`` tokens to random slots of a 30-layer-sized
  cache): torch's ``write_kv_cache`` eagerly, the same under torch.compile, and
  ``tokenmill_cpu.kernels.write_kv_cache``.

Multiply by 30 for a whole step. With ``ATEN_CPU_CAPABILITY=avx2`` an AVX-512 machine gives the AVX2 build's
figures. Results: docs/benchmarks.md, "Prefill attention kernel".
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tokenmill.attention.backends.torch_paged import write_kv_cache
from tokenmill_cpu import kernels
from tokenmill_cpu.platform import separate_inductor_cache

from timing import median_ms, write_json  # benchmarks/timing.py: this script's folder is on sys.path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=15, help="fresh prompts in the step")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--lengths", default=None,
                   help="prompt lengths instead of --prompts x --prompt-len: comma-separated, LxN for N prompts of L")
    p.add_argument("--prefix", type=int, default=0, help="cached tokens before each prompt (0: fresh prompts)")
    p.add_argument("--decodes", type=int, default=48, help="one-token rows of the step (cache write only)")
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=5825, help="cache blocks of 16 tokens (one layer's)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    separate_inductor_cache()  # under ATEN_CPU_CAPABILITY: not the default level's compiled loops
    if not kernels.load():
        raise SystemExit("tokenmill-cpu's kernels did not build; see the log above")
    dtype = getattr(torch, args.dtype)
    h, hkv, d = args.num_heads, args.num_kv_heads, args.head_size
    lengths = [args.prompt_len] * args.prompts
    if args.lengths:
        lengths = [int(part.split("x")[0]) for part in args.lengths.split(",")
                   for _ in range(int(part.split("x")[1]) if "x" in part else 1)]
    g = torch.Generator().manual_seed(0)
    rows = sum(lengths) + args.decodes
    qkv = torch.randn(rows, (h + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, : h * d].view(rows, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(rows, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(rows, hkv, d)
    first = args.decodes  # decodes first, then the prompts, as the scheduler orders a mixed step
    starts = [first + sum(lengths[:i]) for i in range(len(lengths))]
    spans = [(start, start + length) for start, length in zip(starts, lengths)]
    ranges = torch.tensor(spans, dtype=torch.int32)
    out = torch.empty(rows, h * d, dtype=dtype)
    scale = d**-0.5

    def one_by_one() -> None:
        for s, e in spans:
            out[s:e] = kernels.prefill_attention(q[s:e], k[s:e], v[s:e], scale)

    def in_one_call() -> None:
        kernels.prefill_attention_varlen(q, k, v, ranges, scale, None, out)

    def torch_sdpa() -> None:
        for s, e in spans:
            heads = [x[s:e].transpose(0, 1) for x in (q, k, v)]  # [H, L, D]
            o = F.scaled_dot_product_attention(*heads, is_causal=True, scale=scale, enable_gqa=True)
            out[s:e] = o.transpose(0, 1).reshape(e - s, -1)

    cache = torch.zeros(2, hkv, args.num_blocks, 16, d, dtype=dtype)
    slots = (torch.randperm(args.num_blocks * 16, generator=g)[:rows]).long()
    compiled_write = torch.compile(write_kv_cache, dynamic=True)
    with torch.inference_mode():
        one_by_one()
        want = out.clone()
        in_one_call()
        assert torch.allclose(out, want, rtol=1e-5, atol=1e-6), "the two prefill paths disagree"
        torch_sdpa()
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        assert torch.allclose(out, want, rtol=tol, atol=tol), "the kernel and torch's SDPA disagree"
        if args.prefix:
            contexts = [(torch.randn(hkv, args.prefix + n, d, generator=g).to(dtype).transpose(0, 1),
                         torch.randn(hkv, args.prefix + n, d, generator=g).to(dtype).transpose(0, 1)) for n in lengths]

            def after_prefix() -> None:
                for (s, e), (kc, vc) in zip(spans, contexts):
                    out[s:e] = kernels.prefill_attention(q[s:e], kc, vc, scale)

        results = {
            **({"prefill_after_prefix_ms": median_ms(after_prefix, args.iters)} if args.prefix else {}),
            "prefill_one_call_per_prompt_ms": median_ms(one_by_one, args.iters),
            "prefill_one_call_per_step_ms": median_ms(in_one_call, args.iters),
            "prefill_torch_sdpa_ms": median_ms(torch_sdpa, args.iters),
            "write_torch_eager_ms": median_ms(lambda: write_kv_cache(k, v, cache, slots), args.iters),
            "write_torch_compiled_ms": median_ms(lambda: compiled_write(k, v, cache, slots), args.iters),
            "write_kernel_ms": median_ms(lambda: kernels.write_kv_cache(k, v, cache, slots), args.iters),
        }
    shape = f"{len(lengths)} prompts x {lengths[0]} tokens" if len(set(lengths)) == 1 else f"prompts of {args.lengths} tokens"
    print(f"{shape} + {args.decodes} decodes, {h}/{hkv} heads of {d}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, capability {torch.backends.cpu.get_cpu_capability()} "
          f"(ms per layer, median of {args.iters})")
    for name, ms in results.items():
        print(f"{name:34s} {ms:8.3f}")
    gflop = sum(4 * h * d * n * (n + 1) / 2 for n in lengths) / 1e9
    results["prefill_gflop_per_layer"] = gflop
    for name in ("prefill_one_call_per_step_ms", "prefill_torch_sdpa_ms"):
        print(f"{name.replace('_ms', ''):34s} {gflop / results[name] * 1e3:8.1f} GFLOP/s")
    if args.prefix:
        gflop_chunk = sum(4 * h * d * n * (args.prefix + (n + 1) / 2) for n in lengths) / 1e9
        print(f"{'prefill_after_prefix':34s} {gflop_chunk / results['prefill_after_prefix_ms'] * 1e3:8.1f} GFLOP/s")
    if args.json:
        write_json(args.json, {"benchmark": "prefill_attention", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "args": vars(args), "kernels": kernels.isa(), **results})


if __name__ == "__main__":
    main()
