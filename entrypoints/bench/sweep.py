"""``tokenmill bench sweep``: throughput and decode step time as the batch grows.

For each batch size B, B random prompts of I tokens are submitted at once and each generates O tokens. The
figures per B are output tokens/s (B * O over the wall time of the batch) and the mean time of one engine step
while exactly B requests are decoding (steps in which no request is still in prefill). A step's time is
measured twice: the whole ``LLMEngine.step()`` (engine core + front-end output processing) and the engine core
alone. ``benchmarks/plot.py`` turns the JSON into the PNGs of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tokenmill.entrypoints.bench.common import (
    AddArgs,
    add_engine_cli_args,
    add_shared_args,
    base_record,
    check_lengths,
    engine_args_from,
    isa_rows,
    kernel_info,
    peak_rss_bytes,
    print_table,
    random_prompts,
    refuse_data_parallel,
    write_json,
)


def add_parser(subparsers: argparse._SubParsersAction, add_extra_args: AddArgs | None) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="Output tok/s and decode step time for several batch sizes (JSON for benchmarks/plot.py).",
        description="For each batch size, submit that many prompts at once and record output tokens/s and "
                    "the mean engine step time while that many requests decode.",
    )
    parser.add_argument("--batch-sizes", default="1,8,32,64,128,256",
                        help="Comma-separated batch sizes (default 1,8,32,64,128,256).")
    add_shared_args(parser, output_len=64, detokenize=True)
    add_engine_cli_args(parser, add_extra_args)
    parser.set_defaults(func=run)


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]`` (positive, in the given order)."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"tokenmill bench sweep: error: --batch-sizes must be positive integers, got {text!r}")
    return sizes


class _CoreTimer:
    """Times each engine-core step of an ``LLMEngine`` (wraps its client's ``get_output``; seconds)."""

    def __init__(self, engine: Any) -> None:
        self.times: list[float] = []
        client = getattr(engine, "engine_core", None)
        inner = getattr(client, "get_output", None)
        if inner is None:  # another front end: only whole steps are timed
            return

        def timed() -> Any:
            start = time.perf_counter()
            out = inner()
            self.times.append(time.perf_counter() - start)
            return out

        client.get_output = timed


def run_batch(engine: Any, timer: _CoreTimer, prompts: list[list[int]], output_len: int,
              detokenize: bool, tag: str) -> dict[str, Any]:
    """Run one batch to completion; returns output tok/s and per-step times of the pure decode steps."""
    from tokenmill.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=detokenize,
                            output_kind=RequestOutputKind.DELTA)
    started: set[str] = set()
    finished = 0
    decode_steps: list[tuple[int, float, float | None]] = []  # (running, step_s, core_s)
    output_tokens = 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    total = len(prompts)
    while engine.has_unfinished_requests():
        unfinished = total - finished
        pure_decode = len(started) - finished == unfinished
        n_core = len(timer.times)
        t0 = time.perf_counter()
        outputs = engine.step()
        step_s = time.perf_counter() - t0
        core_s = timer.times[-1] if len(timer.times) > n_core else None
        if pure_decode:
            decode_steps.append((unfinished, step_s, core_s))
        for out in outputs:
            new = sum(len(c.token_ids) for c in out.outputs)
            output_tokens += new
            if new:
                started.add(out.request_id)
            if out.finished:
                finished += 1
    elapsed = time.perf_counter() - start
    at_b = [(s, c) for running, s, c in decode_steps if running == total]
    core = [c for _, c in at_b if c is not None]
    return {
        "batch_size": total,
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
        "decode_steps": len(at_b),
        "mean_step_s": statistics.fmean(s for s, _ in at_b) if at_b else None,
        "mean_core_step_s": statistics.fmean(core) if core else None,
    }


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tokenmill bench sweep``; returns the exit code."""
    from tokenmill.engine.llm_engine import LLMEngine

    sizes = parse_batch_sizes(args.batch_sizes)
    refuse_data_parallel(args, "sweep")
    if args.max_num_seqs < max(sizes):
        print(f"--max-num-seqs raised from {args.max_num_seqs} to {max(sizes)} (the largest batch size)")
        args.max_num_seqs = max(sizes)
    engine = LLMEngine.from_engine_args(engine_args_from(args))
    try:
        mc = engine.model_config
        check_lengths(args.input_len, args.output_len, mc.max_model_len)
        tokenizer = engine.get_tokenizer()
        timer = _CoreTimer(engine)
        detok = not args.disable_detokenize
        warm = random_prompts(tokenizer, min(4, max(sizes)), args.input_len, seed=args.seed + 10**6,
                              vocab_size=mc.vocab_size)
        run_batch(engine, timer, warm, min(args.output_len, 8), detok, "warmup")
        points = []
        for b in sizes:
            prompts = random_prompts(tokenizer, b, args.input_len, seed=args.seed + b, vocab_size=mc.vocab_size)
            point = run_batch(engine, timer, prompts, args.output_len, detok, f"b{b}")
            points.append(point)
            step_ms = point["mean_step_s"] * 1000 if point["mean_step_s"] is not None else float("nan")
            print(f"batch {b:>4}: {point['output_tokens_per_s']:9.1f} output tok/s, "
                  f"decode step {step_ms:8.2f} ms ({point['decode_steps']} steps)", flush=True)
        info = {"model": mc.model, "served_model_name": mc.served_model_name, "dtype": mc.dtype,
                "platform": engine.engine_config.device_config.platform}
    finally:
        engine.shutdown()
    rss = peak_rss_bytes()
    rows: list[tuple[str, Any]] = [("Model", info["served_model_name"]), ("dtype", info["dtype"])]
    for p in points:
        rows.append((f"B={p['batch_size']} output tok/s", p["output_tokens_per_s"]))
        if p["mean_step_s"] is not None:
            rows.append((f"B={p['batch_size']} decode step (ms)", p["mean_step_s"] * 1000))
    rows.append(("Peak RSS (MiB)", rss / 2**20))
    record = base_record("sweep", args)
    record.update({"model": info["served_model_name"], "dtype": info["dtype"], "engine": info,
                   "input_len": args.input_len, "output_len": args.output_len, "sweep": points,
                   "peak_rss_bytes": rss})
    rows += isa_rows(record, kernel_info())
    print_table("tokenmill bench sweep", rows)
    if args.json:
        write_json(args.json, record)
    return 0
