"""``tokenmill bench throughput``: offline batch throughput, optionally against transformers ``generate()``.

N random prompts of exactly I tokens each generate exactly O tokens (greedy, ``ignore_eos``), all submitted at
once to the offline engine; the figures are requests/s, output tokens/s and total (input + output) tokens/s
over the wall-clock time of that one ``generate`` call, after a small warm-up.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Sequence
from typing import Any

from tokenmill.entrypoints.bench.common import (
    AddArgs,
    add_engine_cli_args,
    add_shared_args,
    base_record,
    cpu_steal_seconds,
    engine_args_from,
    engine_kernel_info,
    engine_prompts,
    isa_rows,
    kernel_info,
    peak_rss_bytes,
    print_table,
    random_prompts,
    write_json,
)


def add_parser(subparsers: argparse._SubParsersAction, add_extra_args: AddArgs | None) -> None:
    parser = subparsers.add_parser(
        "throughput",
        help="Offline throughput: N prompts of I tokens, O new tokens each.",
        description="Offline throughput of the engine (all prompts submitted at once), optionally compared "
                    "with Hugging Face transformers generate() on the same weights and prompts.",
    )
    add_shared_args(parser, num_prompts=256, detokenize=True, hf_dtypes=True, tqdm=True)
    parser.add_argument("--warmup-prompts", type=int, default=8,
                        help="Prompts of the untimed warm-up run (default 8; 0 = no warm-up).")
    parser.add_argument("--baseline", choices=["hf"], default=None,
                        help="Also run transformers generate() on the same prompts and print the ratio.")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="Prompts per generate() call (default 64).")
    add_engine_cli_args(parser, add_extra_args)
    parser.set_defaults(func=run)


def _figures(num_requests: int, input_tokens: int, output_tokens: int, elapsed: float) -> dict[str, Any]:
    return {
        "elapsed_s": elapsed,
        "num_requests": num_requests,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": num_requests / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed,
    }


def run_tokenmill(args: argparse.Namespace) -> tuple[dict[str, Any], list[list[int]], dict[str, Any]]:
    """Build the engine, warm it up, time one ``generate`` over all prompts; shut the engine down.

    Returns ``(figures, prompts, engine_info)``.
    """
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    engine_args = engine_args_from(args)
    load_start = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args)
    load_s = time.perf_counter() - load_start
    try:
        model_config, tokenizer = engine.model_config, engine.get_tokenizer()
        prompts = engine_prompts(engine, args)
        llm = LLM.from_llm_engine(engine)
        detokenize = not args.disable_detokenize
        if args.warmup_prompts > 0:
            warm = random_prompts(tokenizer, args.warmup_prompts, args.input_len, seed=args.seed + 1,
                                  vocab_size=model_config.vocab_size)
            warm_params = SamplingParams(temperature=0.0, max_tokens=min(args.output_len, 8),
                                         ignore_eos=True, detokenize=detokenize)
            llm.generate(warm, warm_params, use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                                detokenize=detokenize)
        spec = engine.spec_decoding_stats
        before = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) if spec is not None else None
        steal_before = cpu_steal_seconds()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
        elapsed = time.perf_counter() - start
        steal_after = cpu_steal_seconds()
        output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        expected = args.num_prompts * args.output_len
        if len(outputs) != args.num_prompts or output_tokens != expected:
            raise RuntimeError(f"tokenmill returned {len(outputs)} requests / {output_tokens} output tokens, "
                               f"expected {args.num_prompts} / {expected}")
        info = {
            "model": model_config.model,
            "served_model_name": model_config.served_model_name,
            "gguf_file": model_config.gguf_file,
            "dtype": model_config.dtype,
            "max_model_len": model_config.max_model_len,
            "platform": engine.engine_config.device_config.platform,
            "num_kv_blocks": getattr(engine.engine_config.cache_config, "num_gpu_blocks", None),
            "data_parallel_size": engine.engine_config.parallel_config.data_parallel_size,
            "load_s": load_s,
            "kernels": engine_kernel_info(engine),
            # data-parallel engine cores run in their own processes: the largest one's peak
            "engine_core_peak_rss_bytes": (max(engine.engine_core.call_utility_all("peak_rss_bytes"))
                                           if engine.engine_config.parallel_config.data_parallel_size > 1 else None),
        }
        figures = _figures(len(outputs), input_tokens, output_tokens, elapsed)
        figures["cpu_steal_s"] = None if steal_before is None or steal_after is None else steal_after - steal_before
        if spec is not None and before is not None:
            drafts, drafted, accepted = (spec.num_drafts - before[0], spec.num_draft_tokens - before[1],
                                         spec.num_accepted_tokens - before[2])
            figures["spec_decode"] = {
                "num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else None,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            }
        return figures, prompts, info
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def run_hf(args: argparse.Namespace, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The transformers baseline in each of ``--hf-dtypes``; ``best`` names the fastest (output tokens/s)."""
    import torch

    from tokenmill.entrypoints.bench.hf_baseline import hf_throughput, load_hf_model, parse_dtypes

    dtypes = parse_dtypes(args.hf_dtypes)
    hf_model, ids = load_hf_model(args.model)
    warm = [list(p) for p in prompts[: min(4, len(prompts))]]
    per_dtype: dict[str, Any] = {}
    for name in dtypes:
        hf_model.to(getattr(torch, name))
        print(f"transformers generate() baseline, {name}, batch size {args.hf_batch_size} ...", flush=True)
        per_dtype[name] = hf_throughput(hf_model, ids, prompts, args.output_len, args.hf_batch_size, warm)
    del hf_model
    gc.collect()
    best = max(per_dtype, key=lambda d: per_dtype[d]["output_tokens_per_s"])
    return {"name": "transformers", "batch_size": args.hf_batch_size, "dtypes": per_dtype, "best_dtype": best,
            **per_dtype[best]}


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tokenmill bench throughput``; returns the exit code."""
    figures, prompts, info = run_tokenmill(args)
    kernels = info["kernels"] or kernel_info()
    tokenmill_rss = peak_rss_bytes()
    engine_core_rss = info["engine_core_peak_rss_bytes"]
    rows: list[tuple[str, Any]] = [
        ("Model", info["served_model_name"]),
        ("dtype", info["dtype"]),
        ("Requests x input x output", f"{args.num_prompts} x {args.input_len} x {args.output_len}"),
        ("Elapsed (s)", figures["elapsed_s"]),
        ("Requests/s", figures["requests_per_s"]),
        ("Output tokens/s", figures["output_tokens_per_s"]),
        ("Total tokens/s", figures["total_tokens_per_s"]),
        ("Peak RSS (MiB)", tokenmill_rss / 2**20),
        ("CPU steal during the run (s)", figures["cpu_steal_s"]),
    ]
    if engine_core_rss is not None:
        rows[-1:-1] = [("Data-parallel engine cores", info["data_parallel_size"]),
                       ("Peak RSS of one engine core (MiB)", engine_core_rss / 2**20)]
    spec = figures.get("spec_decode")
    if spec is not None:
        rows += [("Draft tokens proposed / accepted", f"{spec['num_draft_tokens']} / {spec['num_accepted_tokens']}"),
                 ("Draft acceptance rate", spec["acceptance_rate"]),
                 ("Mean acceptance length (tokens/step)", spec["mean_acceptance_length"])]
    record = base_record("throughput", args)
    record.update({"model": info["served_model_name"], "dtype": info["dtype"], "engine": info,
                   "tokenmill": figures, "peak_rss_bytes": tokenmill_rss, "engine_core_peak_rss_bytes": engine_core_rss})
    if args.baseline == "hf":
        baseline = run_hf(args, prompts)
        ratio = figures["output_tokens_per_s"] / baseline["output_tokens_per_s"]
        record["baseline"] = baseline
        record["ratio_output_tokens_per_s"] = ratio
        for name, fig in baseline["dtypes"].items():
            rows.append((f"HF {name} output tokens/s", fig["output_tokens_per_s"]))
        rows.append((f"HF best ({baseline['best_dtype']}) elapsed (s)", baseline["elapsed_s"]))
        rows.append(("Ratio tokenmill / HF (output tok/s)", ratio))
    rows += isa_rows(record, kernels)
    print_table("tokenmill bench throughput", rows)
    if args.json:
        write_json(args.json, record)
    return 0
