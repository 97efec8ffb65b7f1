"""Where a decode step's wall time goes, phase by phase, without a profiler's overhead.

    python benchmarks/step_phases.py [--batch 256 --input-len 192 --dtype float32 --steps 10]

Builds an engine core of the embedded default model (or ``--model``) in this process, prefills ``--batch`` random
prompts of ``--input-len`` tokens, runs three warm decode steps, then times ``--steps`` decode steps and prints
the mean milliseconds per step of each phase: the scheduler's ``schedule`` and ``update_from_output``, the
runner's input building, the forward pass (``compiled_runner.run``: layer matmuls, attention, norms), the LM
head (``compute_logits``), the sampling metadata and the sampler, and the minor page faults per step (fresh
pages the step touched: ``getrusage``; the script sets ``TOKENMILL_CPU_PREFAULT=0`` unless it is set, since the CPU
plugin's background fault-in of the KV cache would count here too). Each phase is timed by wrapping the method with ``time.perf_counter``,
which costs about a microsecond per call.
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

os.environ.setdefault("TOKENMILL_CPU_PREFAULT", "0")

from tokenmill.engine.core import EngineCore  # noqa: E402
from tokenmill.engine.messages import EngineCoreRequest  # noqa: E402
from tokenmill.engine_args import EngineArgs  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402
import tokenmill.worker.model_runner as model_runner_module  # noqa: E402

TOTALS: dict[str, float] = collections.defaultdict(float)


def timed(obj: Any, name: str, label: str) -> None:
    """Replace ``obj.name`` by a wrapper adding its wall time to ``TOTALS[label]`` (seconds)."""
    fn: Callable[..., Any] = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--input-len", type=int, default=192)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kv-cache-memory", default="6GiB")
    args = p.parse_args()
    config = EngineArgs(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_model_len=2048,
                        kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=8192).create_engine_config()
    core = EngineCore(config)
    rng = random.Random(0)
    vocab = config.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    for i in range(args.batch):
        core.add_request(EngineCoreRequest(f"r{i}", [rng.randrange(100, vocab) for _ in range(args.input_len)], params))
    while not all(r.num_output_tokens > 0 for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    for _ in range(3):
        core.step()
    if len(core.scheduler.running) != args.batch:
        raise SystemExit(f"only {len(core.scheduler.running)} of {args.batch} requests are running: raise "
                         f"--kv-cache-memory")
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
    for label, total in TOTALS.items():
        print(f"  {label:20s} {total / args.steps * 1000:8.2f} ms")


if __name__ == "__main__":
    main()
