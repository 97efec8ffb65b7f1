"""``tokenmill bench latency``: one request at a time, time to first token and decode speed.

Each run sends one random prompt of exactly I tokens and generates exactly O tokens (greedy, EOS ignored).
TTFT is the time from submitting the request to the first generated token (seconds); the decode rate is
``(O - 1) / (t_last - t_first)`` tokens per second. Figures are medians over ``--num-iters`` runs after
``--num-iters-warmup`` untimed ones; every run uses a fresh prompt, so the prefix cache never helps.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from tokenmill.entrypoints.bench.common import (
    AddArgs,
    add_engine_cli_args,
    base_record,
    check_lengths,
    engine_args_from,
    isa_rows,
    kernel_info,
    peak_rss_bytes,
    print_table,
    random_prompts,
    write_json,
)
from tokenmill.entrypoints.bench.hf_baseline import latency_from_times

Run = Callable[[Sequence[int]], dict[str, Any]]


def add_parser(subparsers: argparse._SubParsersAction, add_extra_args: AddArgs | None) -> None:
    parser = subparsers.add_parser(
        "latency",
        help="Single-request latency: time to first token and decode tokens/s.",
        description="One request at a time: time to first token and decode speed (medians), optionally "
                    "compared with transformers generate() or llama.cpp on the same weights.",
    )
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens I (default 128).")
    parser.add_argument("--output-len", type=int, default=128, help="New tokens O (default 128).")
    parser.add_argument("--num-iters", type=int, default=5, help="Timed runs; medians are reported (default 5).")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="Untimed runs first (default 1).")
    parser.add_argument("--disable-detokenize", action="store_true", help="Token ids only, no text.")
    parser.add_argument("--baseline", choices=["hf", "llamacpp"], default=None,
                        help="hf: transformers generate(); llamacpp: llama-cpp-python on the same GGUF file.")
    parser.add_argument("--hf-dtypes", default="float32,bfloat16",
                        help="dtypes for --baseline hf; the fastest decode counts (default float32,bfloat16).")
    parser.add_argument("--json", default=None, metavar="FILE", help="Write every figure to this JSON file.")
    add_engine_cli_args(parser, add_extra_args)
    parser.set_defaults(func=run)


def measure(run_one: Run, prompts: Sequence[Sequence[int]], warmup: int) -> dict[str, Any]:
    """Run ``run_one`` on each prompt; the first ``warmup`` runs are not counted. Returns medians and runs."""
    runs = [run_one(p) for p in prompts]
    timed = runs[warmup:]
    ttft = statistics.median(r["ttft_s"] for r in timed)
    rates = [r["decode_tokens_per_s"] for r in timed if r["decode_tokens_per_s"] is not None]
    input_len = len(prompts[0])
    return {
        "ttft_s": ttft,
        "prefill_tokens_per_s": input_len / ttft,
        "decode_tokens_per_s": statistics.median(rates) if rates else None,
        "e2e_s": statistics.median(r["e2e_s"] for r in timed),
        "num_iters": len(timed),
        "runs": timed,
    }


def tokenmill_run(engine: Any, output_len: int, detokenize: bool) -> Run:
    """A function timing one request through ``engine``'s step loop (``LLMEngine``)."""
    from tokenmill.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=detokenize,
                            output_kind=RequestOutputKind.DELTA)
    counter = iter(range(1 << 62))

    def run_one(prompt: Sequence[int]) -> dict[str, Any]:
        times: list[float] = []
        start = time.perf_counter()
        engine.add_request(f"latency-{next(counter)}", list(prompt), params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                new = sum(len(c.token_ids) for c in output.outputs)
                if new:
                    now = time.perf_counter()
                    times.extend([now] * new)
        return latency_from_times(start, times, output_len)

    return run_one


def _run_tokenmill(args: argparse.Namespace) -> tuple[dict[str, Any], list[list[int]], dict[str, Any]]:
    from tokenmill.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(engine_args_from(args))
    try:
        mc = engine.model_config
        check_lengths(args.input_len, args.output_len, mc.max_model_len)
        prompts = random_prompts(engine.get_tokenizer(), args.num_iters_warmup + args.num_iters, args.input_len,
                                 seed=args.seed, vocab_size=mc.vocab_size)
        figures = measure(tokenmill_run(engine, args.output_len, not args.disable_detokenize), prompts,
                          args.num_iters_warmup)
        info = {"model": mc.model, "served_model_name": mc.served_model_name, "gguf_file": mc.gguf_file,
                "dtype": mc.dtype, "max_model_len": mc.max_model_len,
                "platform": engine.engine_config.device_config.platform}
        return figures, prompts, info
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def _run_hf(args: argparse.Namespace, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    import torch

    from tokenmill.entrypoints.bench.hf_baseline import hf_latency_run, load_hf_model, parse_dtypes

    hf_model, ids = load_hf_model(args.model)
    per_dtype: dict[str, Any] = {}
    for name in parse_dtypes(args.hf_dtypes):
        hf_model.to(getattr(torch, name))
        print(f"transformers generate() baseline, {name} ...", flush=True)
        per_dtype[name] = measure(lambda p: hf_latency_run(hf_model, ids, p, args.output_len), prompts,
                                  args.num_iters_warmup)
    best = max(per_dtype, key=lambda d: per_dtype[d]["decode_tokens_per_s"] or 0.0)
    return {"name": "transformers", "available": True, "dtypes": per_dtype, "best_dtype": best, **per_dtype[best]}


def _run_llamacpp(args: argparse.Namespace, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    import torch

    from tokenmill.entrypoints.bench.llamacpp_baseline import LlamaCppRunner, llamacpp_unavailable_reason
    from tokenmill.model_loader.hf_config import resolve_model_location

    reason = llamacpp_unavailable_reason(args.model)
    if reason is not None:
        return {"name": "llama.cpp", "available": False, "reason": reason}
    threads = torch.get_num_threads()
    runner = LlamaCppRunner(resolve_model_location(args.model).path, threads, args.input_len + args.output_len + 16)
    print(f"llama.cpp baseline (llama-cpp-python {runner.version}, {threads} threads) ...", flush=True)
    figures = measure(lambda p: runner.latency_run(p, args.output_len), prompts, args.num_iters_warmup)
    return {"name": "llama.cpp", "available": True, "version": runner.version, "threads": threads, **figures}


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tokenmill bench latency``; returns the exit code."""
    if args.num_iters < 1 or args.num_iters_warmup < 0:
        raise SystemExit("tokenmill bench latency: error: --num-iters must be >= 1 and --num-iters-warmup >= 0")
    figures, prompts, info = _run_tokenmill(args)
    kernels = kernel_info()
    rss = peak_rss_bytes()
    rows: list[tuple[str, Any]] = [
        ("Model", info["served_model_name"]),
        ("dtype", info["dtype"]),
        ("Input x output tokens", f"{args.input_len} x {args.output_len}"),
        ("Runs (after warm-up)", figures["num_iters"]),
        ("TTFT, median (s)", figures["ttft_s"]),
        ("Prefill tokens/s (I / TTFT)", figures["prefill_tokens_per_s"]),
        ("Decode tokens/s, median", figures["decode_tokens_per_s"]),
        ("Peak RSS (MiB)", rss / 2**20),
    ]
    record = base_record("latency", args)
    record.update({"model": info["served_model_name"], "dtype": info["dtype"], "engine": info,
                   "tokenmill": figures, "peak_rss_bytes": rss})
    if args.baseline is not None:
        baseline = _run_hf(args, prompts) if args.baseline == "hf" else _run_llamacpp(args, prompts)
        record["baseline"] = baseline
        label = baseline["name"] + (f" {baseline['best_dtype']}" if "best_dtype" in baseline else "")
        if not baseline["available"]:
            print(f"baseline {baseline['name']} not run: {baseline['reason']}")
            rows.append((f"{label}", "not available"))
        else:
            rows += [(f"{label} TTFT, median (s)", baseline["ttft_s"]),
                     (f"{label} decode tokens/s, median", baseline["decode_tokens_per_s"])]
            if figures["decode_tokens_per_s"] and baseline["decode_tokens_per_s"]:
                ratio = figures["decode_tokens_per_s"] / baseline["decode_tokens_per_s"]
                record["ratio_decode_tokens_per_s"] = ratio
                record["ratio_ttft"] = baseline["ttft_s"] / figures["ttft_s"]
                rows += [(f"Ratio tokenmill / {baseline['name']} (decode tok/s)", ratio),
                         (f"Ratio {baseline['name']} / tokenmill (TTFT)", record["ratio_ttft"])]
    rows += isa_rows(record, kernels)
    print_table("tokenmill bench latency", rows)
    if args.json:
        write_json(args.json, record)
    return 0
