"""``tokenmill bench structured``: the cost of structured outputs under load.

N random prompts of I tokens are run through the offline engine with ``max_num_seqs = C`` (so C requests run
at once while the queue lasts), each asking for O tokens (greedy, ``ignore_eos``). Two workloads are timed in
the same process, alternately, ``--repeats`` times each after a warm-up: every request unconstrained, and a
fraction F of them constrained by a JSON schema (default: an array of at least 200 small objects, so a
constrained request also runs to O tokens). The figures are output tokens/s (medians) and their ratio, plus
where the constrained run's time goes: scheduler bitmask fills, matcher advances and the worker's logits masking,
each as a share of the wall-clock time.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from tokenmill.entrypoints.bench.common import (
    AddArgs,
    add_engine_cli_args,
    add_shared_args,
    base_record,
    engine_args_from,
    engine_prompts,
    isa_rows,
    kernel_info,
    print_table,
    random_prompts,
    refuse_data_parallel,
    write_json,
)

DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 200,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "role": {"enum": ["admin", "user", "guest"]},
                    "active": {"type": "boolean"},
                },
                "required": ["name", "age", "role", "active"],
            },
        }
    },
    "required": ["people"],
}


def add_parser(subparsers: argparse._SubParsersAction, add_extra_args: AddArgs | None) -> None:
    parser = subparsers.add_parser(
        "structured",
        help="Structured-output cost: C concurrent requests, a fraction constrained by a JSON schema.",
        description="Output throughput of the engine with a fraction of the requests constrained by a JSON "
                    "schema, against the same requests unconstrained, measured alternately in one process.",
    )
    add_shared_args(parser, num_prompts=96, num_prompts_help="Requests per run N")
    parser.add_argument("--concurrency", type=int, default=32,
                        help="Requests running at once C (sets --max-num-seqs; default 32).")
    parser.add_argument("--constrained-fraction", type=float, default=0.5,
                        help="Fraction F of the requests constrained by the schema (default 0.5).")
    parser.add_argument("--repeats", type=int, default=3, help="Timed runs of each workload (default 3).")
    parser.add_argument("--schema", default=None, metavar="FILE",
                        help="JSON schema file for the constrained requests (default: a long array of objects).")
    add_engine_cli_args(parser, add_extra_args)
    parser.set_defaults(func=run)


class _Timers:
    """Wraps callables and sums their wall-clock time (seconds) by label while ``enabled``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.enabled = False

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self.calls[label] = self.calls.get(label, 0) + 1

        return timed

    def take(self) -> dict[str, dict[str, float]]:
        out = {k: {"seconds": v, "calls": self.calls[k]} for k, v in self.seconds.items()}
        self.seconds, self.calls = {}, {}
        return out


def _instrument(engine: Any) -> _Timers:
    """Time the structured-output work of the in-process engine core (the wrappers cost ~1 us a call)."""
    import tokenmill.worker.model_runner as model_runner

    timers = _Timers()
    core = engine.engine_core.engine_core
    scheduler = core.scheduler
    manager = scheduler.structured_output_manager
    manager.grammar_bitmask = timers.wrap("bitmask_fill", manager.grammar_bitmask)
    scheduler._advance_grammar = timers.wrap("matcher_advance", scheduler._advance_grammar)
    model_runner.apply_grammar_bitmask = timers.wrap("logits_masking", model_runner.apply_grammar_bitmask)
    core.executor.execute_model = timers.wrap("execute_model", core.executor.execute_model)
    core.step = timers.wrap("engine_step", core.step)
    return timers


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tokenmill bench structured``; returns the exit code."""
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

    if not 0.0 <= args.constrained_fraction <= 1.0:
        raise ValueError(f"--constrained-fraction must be in [0, 1], got {args.constrained_fraction}")
    refuse_data_parallel(args, "structured")
    schema = DEFAULT_SCHEMA
    if args.schema:
        with open(args.schema, encoding="utf-8") as f:
            schema = json.load(f)
    args.max_num_seqs = args.concurrency
    engine = LLMEngine.from_engine_args(engine_args_from(args))
    try:
        model_config, tokenizer = engine.model_config, engine.get_tokenizer()
        prompts = engine_prompts(engine, args)
        llm = LLM.from_llm_engine(engine)
        plain = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        constrained = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                                     structured_outputs=StructuredOutputsParams(json=schema))
        num_constrained = round(args.num_prompts * args.constrained_fraction)
        # Constrained requests spread evenly through the queue (every k-th), so the running batch stays mixed.
        step = args.num_prompts / num_constrained if num_constrained else 0
        constrained_rows = {int(i * step) for i in range(num_constrained)}
        mixed = [constrained if i in constrained_rows else plain for i in range(args.num_prompts)]
        workloads = {"unconstrained": [plain] * args.num_prompts, "mixed": mixed}

        warm = random_prompts(tokenizer, 4, args.input_len, seed=args.seed + 1, vocab_size=model_config.vocab_size)
        start = time.perf_counter()
        llm.generate(warm[:1], [SamplingParams(temperature=0.0, max_tokens=2, structured_outputs=
                                               StructuredOutputsParams(json=schema))], use_tqdm=False)
        first_constrained_s = time.perf_counter() - start  # tokenizer load + grammar compile + 2 tokens
        llm.generate(warm, [plain, constrained, plain, constrained], use_tqdm=False)

        timers = _instrument(engine)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in workloads}
        for r in range(args.repeats):
            order = list(workloads) if r % 2 == 0 else list(reversed(workloads))
            for name in order:
                timers.enabled = True
                start = time.perf_counter()
                outputs = llm.generate(prompts, workloads[name], use_tqdm=False)
                elapsed = time.perf_counter() - start
                timers.enabled = False
                tokens = [len(c.token_ids) for o in outputs for c in o.outputs]
                lengths_c = [tokens[i] for i in sorted(constrained_rows)] if name == "mixed" else []
                runs[name].append({
                    "elapsed_s": elapsed,
                    "output_tokens": sum(tokens),
                    "output_tokens_per_s": sum(tokens) / elapsed,
                    "mean_constrained_output_tokens": statistics.fmean(lengths_c) if lengths_c else None,
                    "timers": timers.take(),
                })
                print(f"run {r + 1}/{args.repeats} {name}: {sum(tokens) / elapsed:,.1f} output tokens/s", flush=True)
    finally:
        engine.shutdown()
        del engine
        gc.collect()

    def median(name: str, key: str) -> float:
        return statistics.median(run_[key] for run_ in runs[name])

    base, mix = median("unconstrained", "output_tokens_per_s"), median("mixed", "output_tokens_per_s")
    ratio = mix / base
    mixed_runs = sorted(runs["mixed"], key=lambda x: x["output_tokens_per_s"])
    typical = mixed_runs[len(mixed_runs) // 2]
    shares = {label: t["seconds"] / typical["elapsed_s"] for label, t in typical["timers"].items()}
    rows: list[tuple[str, Any]] = [
        ("Model", model_config.served_model_name),
        ("Requests x input x output", f"{args.num_prompts} x {args.input_len} x {args.output_len}"),
        ("Concurrency / constrained", f"{args.concurrency} / {num_constrained}"),
        ("First constrained request (s)", first_constrained_s),
        ("Unconstrained output tok/s (median)", base),
        ("Mixed output tok/s (median)", mix),
        ("Ratio mixed / unconstrained", ratio),
        ("Constrained mean output tokens", typical["mean_constrained_output_tokens"]),
    ]
    for label in ("bitmask_fill", "matcher_advance", "logits_masking", "execute_model"):
        if label in shares:
            rows.append((f"Mixed: {label} (% of wall)", 100.0 * shares[label]))
    record = base_record("structured", args)
    rows += isa_rows(record, kernel_info())
    print_table("tokenmill bench structured", rows)
    record.update({
        "model": model_config.served_model_name,
        "schema": schema,
        "num_constrained": num_constrained,
        "first_constrained_request_s": first_constrained_s,
        "runs": runs,
        "median_output_tokens_per_s": {"unconstrained": base, "mixed": mix},
        "ratio_mixed_over_unconstrained": ratio,
        "typical_mixed_time_shares": shares,
    })
    if args.json:
        write_json(args.json, record)
    return 0
