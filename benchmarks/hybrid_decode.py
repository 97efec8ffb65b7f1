"""Decode speed and cache memory of a hybrid (state + attention) model against a dense one, by context length.

Builds random-weight models of about the same size with transformers' config classes (nothing is downloaded):

* ``dense``: Llama, every layer attention;
* ``hybrid``: Granite 4.0-H layout (``GraniteMoeHybridConfig`` without experts), three Mamba2 layers for each
  attention layer;
* ``mamba2``: Mamba2, no attention layer.

For each model and context length, ``--batch`` requests with prompts of that many tokens are prefilled
(untimed), then ``--steps`` decode steps are timed. Prints decode tokens per second and the cache memory one
request holds at that context: KV blocks of the attention layers (grows with the context) plus its state slot
(constant), from the engine's own sizes. The hybrid and Mamba2 lines show the state layers' flat cost.

Usage (the 32k context needs minutes of prefill on a CPU):

    python benchmarks/hybrid_decode.py --contexts 1024,8192,32768 --batch 4 --steps 16
    python benchmarks/hybrid_decode.py --contexts 1024 --batch 2 --steps 8 --models dense,hybrid   # quick
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

import torch

from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.engine_args import EngineArgs
from tokenmill.sampling_params import SamplingParams

MiB = 1 << 20


def build(kind: str, path: str, hidden: int, layers: int, max_len: int) -> tuple[str, int]:
    """Save a random model of ``kind`` under ``path``; returns (path, parameter count)."""
    import transformers

    heads = max(1, hidden // 64)
    common = dict(vocab_size=512, hidden_size=hidden, num_hidden_layers=layers, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    if kind == "dense":
        config = transformers.LlamaConfig(**common, intermediate_size=3 * hidden, num_attention_heads=heads,
                                          num_key_value_heads=heads, max_position_embeddings=max_len)
        model_cls = transformers.LlamaForCausalLM
    elif kind == "hybrid":
        types = ["attention" if i % 4 == 3 else "mamba" for i in range(layers)]
        config = transformers.GraniteMoeHybridConfig(
            **common, num_attention_heads=heads, num_key_value_heads=heads, shared_intermediate_size=3 * hidden,
            num_local_experts=0, layer_types=types, mamba_n_heads=2 * hidden // 64, mamba_d_head=64,
            mamba_n_groups=1, mamba_d_state=64, mamba_expand=2, mamba_chunk_size=256, position_embedding_type="rope",
            max_position_embeddings=max_len)
        model_cls = transformers.GraniteMoeHybridForCausalLM
    elif kind == "mamba2":
        config = transformers.Mamba2Config(**common, num_heads=2 * hidden // 64, head_dim=64, expand=2, n_groups=1,
                                           state_size=64, chunk_size=256)
        model_cls = transformers.Mamba2ForCausalLM
    else:
        raise SystemExit(f"--models: unknown model {kind!r} (dense, hybrid, mamba2)")
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def run(model_dir: str, context: int, args: argparse.Namespace) -> tuple[float, int]:
    """(decode tokens per second, cache bytes one request holds after the timed steps)."""
    total = context + args.steps + 4
    config = EngineArgs(model=model_dir, dtype=args.dtype, max_model_len=total + 16, max_num_seqs=args.batch,
                        kv_cache_memory=args.kv_cache_memory, enforce_eager=True,
                        enable_prefix_caching=False).create_engine_config()
    core = EngineCore(config)
    try:
        rng = random.Random(0)
        params = SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True)
        for i in range(args.batch):
            core.add_request(EngineCoreRequest(f"r{i}", [rng.randrange(3, 500) for _ in range(context)], params,
                                               eos_token_id=None))
        while core.scheduler.waiting or not all(r.num_output_tokens > 0 for r in core.scheduler.running):
            core.step()  # prefill
        core.step()  # one warm decode step
        if len(core.scheduler.running) != args.batch:
            raise SystemExit(f"only {len(core.scheduler.running)} of {args.batch} requests run: raise "
                             "--kv-cache-memory")
        start = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        elapsed = time.perf_counter() - start
        runner = core.executor.worker.model_runner
        kv = core.scheduler.kv_cache_manager
        blocks = len(kv.get_block_ids(core.scheduler.running[0].request_id))
        held = blocks * runner.kv_cache_bytes_per_block() + runner.state_bytes_per_slot()
        return args.batch * args.steps / elapsed, held
    finally:
        core.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="dense,hybrid,mamba2")
    p.add_argument("--contexts", default="1024,8192,32768", help="prompt lengths (tokens), comma-separated")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--out-dir", default=None, help="where the random models go (default: a temporary folder)")
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    root = args.out_dir or tempfile.mkdtemp(prefix="hybrid_bench_")
    print(f"{'model':8s} {'params':>8s} {'context':>8s} {'decode tok/s':>13s} {'cache MiB / request':>20s}")
    for kind in args.models.split(","):
        model_dir, params = build(kind, os.path.join(root, kind), args.hidden, args.layers, max(contexts) + 64)
        for context in contexts:
            tps, held = run(model_dir, context, args)
            print(f"{kind:8s} {params / 1e6:7.1f}M {context:8d} {tps:13.1f} {held / MiB:20.2f}", flush=True)


if __name__ == "__main__":
    main()
