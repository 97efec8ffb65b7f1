"""``tokenmill bench latency``: one request at a time, time to first token and decode speed.

Each run sends one random prompt of exactly I tokens and generates exactly O tokens (greedy, EOS ignored).
TTFT is the time from submitting the request to the first generated token (seconds); the decode rate is
``(O - 1) / (t_last - t_first)`` tokens per second. Figures are medians over ``--num-iters`` runs after
``--num-iters-warmup`` untimed ones; every run uses a fresh prompt, so the prefix cache never helps.

``--dataset-name quote`` uses prompts of about I tokens that ask the model to repeat a passage (a copying task,
where n-gram speculation proposes well) instead of random tokens. With ``--speculative-config`` the table adds
the draft acceptance of the timed runs; ``--baseline no-spec`` runs the same engine without speculation on the
same prompts in the same process, the two engines alternating prompt by prompt (so load changes on a shared
machine hit both alike), and reports the speed-up and whether the outputs were identical.
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
from tokenmill.entrypoints.bench.hf_baseline import latency_from_times

Run = Callable[[Sequence[int]], dict[str, Any]]


def add_parser(subparsers: argparse._SubParsersAction, add_extra_args: AddArgs | None) -> None:
    parser = subparsers.add_parser(
        "latency",
        help="Single-request latency: time to first token and decode tokens/s.",
        description="One request at a time: time to first token and decode speed (medians), optionally "
                    "compared with transformers generate() or llama.cpp on the same weights.",
    )
    add_shared_args(parser, detokenize=True, hf_dtypes=True)
    parser.add_argument("--num-iters", type=int, default=5, help="Timed runs; medians are reported (default 5).")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="Untimed runs first (default 1).")
    parser.add_argument("--baseline", choices=["hf", "llamacpp", "no-spec"], default=None,
                        help="hf: transformers generate(); llamacpp: llama-cpp-python on the same GGUF file; "
                             "no-spec: tokenmill without --speculative-config (alternating with it).")
    parser.add_argument("--dataset-name", choices=["random", "quote"], default="random",
                        help="random: random tokens, exactly I per prompt; quote: prompts of about I tokens asking "
                             "to repeat a passage word for word (default random).")
    add_engine_cli_args(parser, add_extra_args)
    parser.set_defaults(func=run)


def measure(run_one: Run, prompts: Sequence[Sequence[int]], warmup: int) -> dict[str, Any]:
    """Run ``run_one`` on each prompt; the first ``warmup`` runs are not counted. Returns medians and runs."""
    return summarize_runs([run_one(p) for p in prompts], warmup, len(prompts[0]))


def summarize_runs(runs: Sequence[dict[str, Any]], warmup: int, input_len: int) -> dict[str, Any]:
    """Medians over ``runs[warmup:]`` (and summed speculative-decoding counters when the runs have them)."""
    timed = list(runs[warmup:])
    ttft = statistics.median(r["ttft_s"] for r in timed)
    rates = [r["decode_tokens_per_s"] for r in timed if r["decode_tokens_per_s"] is not None]
    spec = None
    if timed and "spec" in timed[0]:
        spec = {key: sum(r["spec"][key] for r in timed) for key in timed[0]["spec"]}
        spec["acceptance_rate"] = (spec["num_accepted_tokens"] / spec["num_draft_tokens"]
                                   if spec["num_draft_tokens"] else None)
        spec["mean_acceptance_length"] = 1 + spec["num_accepted_tokens"] / spec["num_drafts"] if spec["num_drafts"] else None
    return {
        "ttft_s": ttft,
        "prefill_tokens_per_s": input_len / ttft,
        "decode_tokens_per_s": statistics.median(rates) if rates else None,
        "e2e_s": statistics.median(r["e2e_s"] for r in timed),
        "num_iters": len(timed),
        "runs": timed,
        **({"spec_decode": spec} if spec is not None else {}),
    }


def tokenmill_run(engine: Any, output_len: int, detokenize: bool) -> Run:
    """A function timing one request through ``engine``'s step loop (``LLMEngine``)."""
    from tokenmill.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=detokenize,
                            output_kind=RequestOutputKind.DELTA)
    counter = iter(range(1 << 62))

    def run_one(prompt: Sequence[int]) -> dict[str, Any]:
        times: list[float] = []
        token_ids: list[int] = []
        spec = getattr(engine, "spec_decoding_stats", None)
        before = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) if spec is not None else None
        start = time.perf_counter()
        engine.add_request(f"latency-{next(counter)}", list(prompt), params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                new = sum(len(c.token_ids) for c in output.outputs)
                if new:
                    now = time.perf_counter()
                    times.extend([now] * new)
                    token_ids.extend(t for c in output.outputs for t in c.token_ids)
        result = latency_from_times(start, times, output_len)
        result["token_ids"] = token_ids
        if spec is not None and before is not None:
            result["spec"] = {"num_drafts": spec.num_drafts - before[0],
                              "num_draft_tokens": spec.num_draft_tokens - before[1],
                              "num_accepted_tokens": spec.num_accepted_tokens - before[2]}
        return result

    return run_one


def _make_prompts(args: argparse.Namespace, engine: Any) -> list[list[int]]:
    mc = engine.model_config
    num = args.num_iters_warmup + args.num_iters
    if args.dataset_name == "quote":
        from tokenmill.entrypoints.bench.quote_prompts import quote_prompts

        prompts = quote_prompts(engine.get_tokenizer(), num, args.input_len, seed=args.seed)
    else:
        prompts = random_prompts(engine.get_tokenizer(), num, args.input_len, seed=args.seed,
                                 vocab_size=mc.vocab_size)
    check_lengths(max(len(p) for p in prompts), args.output_len, mc.max_model_len)
    return prompts


def _run_tokenmill(
    args: argparse.Namespace,
) -> tuple[dict[str, Any], list[list[int]], dict[str, Any], dict[str, Any] | None]:
    """tokenmill's figures, the prompts, engine facts and (``--baseline no-spec``) the no-speculation figures."""
    from tokenmill.engine.llm_engine import LLMEngine

    engine_args = engine_args_from(args)
    if args.baseline == "no-spec" and engine_args.speculative_config is None:
        raise SystemExit("tokenmill bench latency: error: --baseline no-spec needs --speculative-config")
    engine = LLMEngine.from_engine_args(engine_args)
    baseline_engine = None
    try:
        mc = engine.model_config
        prompts = _make_prompts(args, engine)
        run_one = tokenmill_run(engine, args.output_len, not args.disable_detokenize)
        no_spec = None
        if args.baseline == "no-spec":
            baseline_engine = LLMEngine.from_engine_args(engine_args.replace(speculative_config=None))
            run_base = tokenmill_run(baseline_engine, args.output_len, not args.disable_detokenize)
            runs, base_runs = [], []
            for p in prompts:  # alternate, so a change of load on the machine affects both alike
                runs.append(run_one(p))
                base_runs.append(run_base(p))
            figures = summarize_runs(runs, args.num_iters_warmup, len(prompts[0]))
            no_spec = {"name": "tokenmill without speculation", "available": True,
                       **summarize_runs(base_runs, args.num_iters_warmup, len(prompts[0]))}
            same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(runs, base_runs))
            no_spec["identical_outputs"] = f"{same}/{len(runs)}"
        else:
            figures = measure(run_one, prompts, args.num_iters_warmup)
        spec = engine.engine_config.speculative_config
        info = {"model": mc.model, "served_model_name": mc.served_model_name, "gguf_file": mc.gguf_file,
                "dtype": mc.dtype, "max_model_len": mc.max_model_len,
                "platform": engine.engine_config.device_config.platform,
                "speculative_config": spec.summary() if spec is not None else None,
                "prompt_lens": [len(p) for p in prompts]}
        return figures, prompts, info, no_spec
    finally:
        engine.shutdown()
        if baseline_engine is not None:
            baseline_engine.shutdown()
        del engine, baseline_engine
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
    refuse_data_parallel(args, "latency")
    figures, prompts, info, no_spec = _run_tokenmill(args)
    kernels = kernel_info()
    rss = peak_rss_bytes()
    rows: list[tuple[str, Any]] = [
        ("Model", info["served_model_name"]),
        ("dtype", info["dtype"]),
        ("Input x output tokens", f"{statistics.median(info['prompt_lens']):g} x {args.output_len}"
                                  + (" (quote task)" if args.dataset_name == "quote" else "")),
        ("Runs (after warm-up)", figures["num_iters"]),
        ("TTFT, median (s)", figures["ttft_s"]),
        ("Prefill tokens/s (I / TTFT)", figures["prefill_tokens_per_s"]),
        ("Decode tokens/s, median", figures["decode_tokens_per_s"]),
        ("Peak RSS (MiB)", rss / 2**20),
    ]
    spec = figures.get("spec_decode")
    if spec is not None:
        rows[1:1] = [("Speculative decoding", info["speculative_config"])]
        rows += [("Draft tokens proposed / accepted", f"{spec['num_draft_tokens']} / {spec['num_accepted_tokens']}"),
                 ("Draft acceptance rate", spec["acceptance_rate"]),
                 ("Mean acceptance length (tokens/step)", spec["mean_acceptance_length"])]
    record = base_record("latency", args)
    record.update({"model": info["served_model_name"], "dtype": info["dtype"], "engine": info,
                   "tokenmill": figures, "peak_rss_bytes": rss})
    if args.baseline is not None:
        if args.baseline == "no-spec":
            baseline = no_spec
        else:
            baseline = _run_hf(args, prompts) if args.baseline == "hf" else _run_llamacpp(args, prompts)
        assert baseline is not None
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
            if "identical_outputs" in baseline:
                record["ratio_e2e"] = baseline["e2e_s"] / figures["e2e_s"]
                rows += [(f"Ratio {baseline['name']} / tokenmill (end-to-end time)", record["ratio_e2e"]),
                         ("Identical outputs with and without speculation", baseline["identical_outputs"])]
    rows += isa_rows(record, kernels)
    print_table("tokenmill bench latency", rows)
    if args.json:
        write_json(args.json, record)
    return 0
