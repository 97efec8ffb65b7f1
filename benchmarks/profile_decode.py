"""Where a decode step's time goes: torch.profiler over decode steps of the engine core.

Usage (the figures in docs/benchmarks.md, "Offline throughput against the matmul ceiling"):

    python benchmarks/profile_decode.py --batch 1 --dtype bfloat16 --quantization int4 [--enforce-eager]
    python benchmarks/profile_decode.py --batch 256 --dtype bfloat16
    python benchmarks/profile_decode.py --batch 64 --dtype bfloat16 --prefill   # the prefill steps instead
    python benchmarks/profile_decode.py --batch 256 --input-len 192 --phases    # wall time by phase, no profiler

With ``--prefill`` the profiled steps are those that prefill the ``--batch`` prompts (2,048 tokens per step,
the default budget); the line printed gives their total time and prompt tokens per second.

Prints the mean wall time of a decode step (milliseconds, profiler overhead included) and the torch operators
sorted by self CPU time. Uses the embedded default model unless ``--model`` is given.

With ``--phases`` there is no profiler: each phase of the decode steps is timed by wrapping its method with
``time.perf_counter`` (about a microsecond per call), and the mean milliseconds per step are printed for the
scheduler's ``schedule`` and ``update_from_output``, the runner's input building, the forward pass
(``compiled_runner.run``: layer matmuls, attention, norms), the LM head (``compute_logits``), the sampling
metadata and the sampler, with the minor page faults per step (``getrusage``: fresh pages the step touched;
``TOKENMILL_CPU_PREFAULT`` defaults to 0 there, since the CPU plugin's background fault-in of the KV cache
would count too).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import resource
import time
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile

from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.engine_args import EngineArgs
from tokenmill.sampling_params import SamplingParams
import tokenmill.worker.model_runner as model_runner_module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=1, help="running requests (all decoding while profiled)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None, choices=[None, "int8", "int4"])
    p.add_argument("--steps", type=int, default=10, help="decode steps profiled")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile of the forward pass")
    p.add_argument("--prefill", action="store_true", help="profile the prompts' prefill steps, not decode steps")
    p.add_argument("--phases", action="store_true", help="decode steps' wall time by phase, without the profiler")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--kv-cache-memory", default="6GiB",
                   help="KV cache size; it must hold --batch requests (checked): float32 SmolLM2-135M takes 45 KiB "
                        "per token, so 256 x 200 tokens need 2.2 GiB")
    args = p.parse_args()
    if args.phases:
        os.environ.setdefault("TOKENMILL_CPU_PREFAULT", "0")
    config = EngineArgs(model=args.model, dtype=args.dtype, quantization=args.quantization, max_model_len=2048,
                        kv_cache_dtype=args.kv_cache_dtype,
                        kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=2048 if args.prefill else 8192,
                        enforce_eager=args.enforce_eager).create_engine_config()
    core = EngineCore(config)
    rng = random.Random(0)
    vocab = config.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    mode = "eager" if args.enforce_eager else "compiled where supported"
    if args.prefill:
        profile_prefill(core, args, params, rng, vocab, mode)
        return
    for i in range(args.batch):
        core.add_request(EngineCoreRequest(f"r{i}", [rng.randrange(100, vocab) for _ in range(args.input_len)], params))
    while not all(r.num_output_tokens > 0 for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()  # prefill
    core.step()  # one warm decode step
    if len(core.scheduler.running) != args.batch:  # a KV cache too small for the batch preempts requests
        raise SystemExit(f"only {len(core.scheduler.running)} of {args.batch} requests are running: raise "
                         f"--kv-cache-memory")
    if args.phases:
        time_phases(core, args)
        return
    with profile(activities=[ProfilerActivity.CPU], record_shapes=os.environ.get("PROFILE_SHAPES") == "1") as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        step_ms = (time.perf_counter() - start) / args.steps * 1000
    print(f"batch {args.batch}, {args.dtype}, quantization {args.quantization}, {mode}: decode step {step_ms:.1f} ms")
    shapes = os.environ.get("PROFILE_SHAPES") == "1"
    print(prof.key_averages(group_by_input_shape=shapes).table(sort_by="self_cpu_time_total", row_limit=15))


def time_phases(core: EngineCore, args: argparse.Namespace) -> None:
    """``--phases``: the mean wall milliseconds per decode step of each phase (see the module docstring)."""
    totals: dict[str, float] = collections.defaultdict(float)

    def timed(obj: Any, name: str, label: str) -> None:
        fn: Callable[..., Any] = getattr(obj, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[label] += time.perf_counter() - start

        setattr(obj, name, wrapper)

    runner = core.executor.worker.model_runner
    timed(core.scheduler, "schedule", "schedule")
    timed(model_runner_module, "build_batch_inputs", "build inputs")
    if runner.compiled_runner is not None:
        timed(runner.compiled_runner, "run", "forward (compiled)")
    timed(runner.model, "compute_logits", "LM head")
    timed(model_runner_module, "build_sampling_metadata", "sampling metadata")
    timed(runner, "sampler", "sampler")
    timed(core.scheduler, "update_from_output", "update from output")
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    step_ms = (time.perf_counter() - start) / args.steps * 1000
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
    print(f"batch {args.batch}, context {args.input_len}+, {args.dtype}, KV cache {args.kv_cache_dtype}: decode step "
          f"{step_ms:.1f} ms, {faults:.0f} minor page faults per step")
    for label, total in totals.items():
        print(f"  {label:20s} {total / args.steps * 1000:8.2f} ms")


def profile_prefill(core: EngineCore, args: argparse.Namespace, params: SamplingParams, rng: random.Random,
                    vocab: int, mode: str) -> None:
    def add(n: int, tag: str) -> None:
        for i in range(n):
            prompt = [rng.randrange(100, vocab) for _ in range(args.input_len)]
            core.add_request(EngineCoreRequest(f"{tag}{i}", prompt, params))

    add(8, "warm")  # one untimed round of prefill and decode
    while core.scheduler.waiting or core.scheduler.running:
        core.step()
    add(args.batch, "r")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start, steps = time.perf_counter(), 0
        while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
            core.step()
            steps += 1
        elapsed = time.perf_counter() - start
    tokens = args.batch * args.input_len
    print(f"prefill of {args.batch} x {args.input_len} tokens, {args.dtype}, {mode}: {steps} steps, {elapsed:.2f} s, "
          f"{tokens / elapsed:.0f} prompt tokens/s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
