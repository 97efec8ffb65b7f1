"""``tokenmill bench embed``: embedding throughput (sequences/s), optionally against sentence-transformers.

For each length L of ``--input-len`` (default 128 and 512), N texts (``--num-prompts``) that tokenize to exactly
L tokens each (special tokens included; random words of the vocabulary, seeded) are embedded with
``LLM.embed`` (tokenization included), all N at once, ``--num-iters-warmup`` untimed times and ``--num-iters``
timed times; sequences/s is N divided by the median time. With ``--baseline sentence-transformers``,
``SentenceTransformer.encode`` (batches of ``--st-batch-size``) embeds the same texts in this process, once in
each of ``--st-dtypes`` (the fastest counts), its runs alternating with tokenmill's so that a change of load on
the machine hits both alike; the table gives the ratio, and the lowest cosine similarity between tokenmill's
and sentence-transformers' float32 embeddings of the same text shows that both computed the same thing.
"""

from __future__ import annotations

import argparse
import gc
import random
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from tokenmill.entrypoints.bench.common import (
    AddArgs,
    add_engine_cli_args,
    add_shared_args,
    base_record,
    engine_args_from,
    engine_kernel_info,
    isa_rows,
    kernel_info,
    parse_lengths,
    peak_rss_bytes,
    print_table,
    refuse_data_parallel,
    write_json,
)
from tokenmill.entrypoints.bench.hf_baseline import parse_dtypes

_WORD = re.compile(r"[a-z]{2,}")


def add_parser(subparsers: argparse._SubParsersAction, add_extra_args: AddArgs | None) -> None:
    parser = subparsers.add_parser(
        "embed",
        help="Embedding throughput: sequences/s at given lengths, optionally against sentence-transformers.",
        description="Embedding throughput of a pooling model (LLM.embed, N texts of L tokens at once), optionally "
                    "compared with sentence-transformers' encode on the same texts in the same process.",
    )
    add_shared_args(parser, output_len=None, num_prompts=64, num_prompts_help="Texts N per length",
                    input_lens="128,512")
    parser.add_argument("--num-iters", type=int, default=3, help="Timed runs per length; medians count (default 3).")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="Untimed runs first (default 1).")
    parser.add_argument("--baseline", choices=["sentence-transformers"], default=None,
                        help="Also time sentence_transformers.SentenceTransformer.encode on the same texts.")
    parser.add_argument("--st-dtypes", default="float32,bfloat16",
                        help="dtypes of the sentence-transformers baseline; the fastest counts "
                             "(default float32,bfloat16).")
    parser.add_argument("--st-batch-size", type=int, default=32,
                        help="encode()'s batch size (default 32, sentence-transformers' own default).")
    add_engine_cli_args(parser, add_extra_args)
    parser.set_defaults(func=run)


def word_texts(tokenizer: Any, num_texts: int, num_tokens: int, *, seed: int) -> list[str]:
    """``num_texts`` texts of random vocabulary words that ``tokenizer`` encodes (special tokens included) to
    exactly ``num_tokens`` ids each. The same seed gives the same texts.

    Only words that encode to one token on their own are used (lowercase letters), so the length is exact for
    WordPiece vocabularies and, after a check and adjustment per text, for byte-level BPE ones.

    Raises:
        ValueError: ``num_tokens`` leaves no room for a word, or the vocabulary has too few usable words, or a
            text cannot be brought to the length.
    """
    rng = random.Random(seed)
    specials = len(tokenizer("")["input_ids"])
    if num_tokens <= specials:
        raise ValueError(f"--input-len {num_tokens}: the tokenizer adds {specials} special tokens; nothing is left")
    special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [i for i in range(len(tokenizer)) if i not in special_ids]
    rng.shuffle(ids)
    words: list[str] = []
    for token_id in ids[:20000]:
        word = tokenizer.decode([token_id]).strip()
        if _WORD.fullmatch(word) and len(tokenizer(" " + word, add_special_tokens=False)["input_ids"]) == 1:
            words.append(word)
            if len(words) >= 2000:
                break
    if len(words) < 50:
        raise ValueError(f"the tokenizer's vocabulary has only {len(words)} single-token lowercase words; "
                         "bench embed needs at least 50 to build its texts")
    texts: list[str] = []
    for _ in range(num_texts):
        chosen = [rng.choice(words) for _ in range(num_tokens - specials)]
        for _ in range(8):  # byte-level BPE may merge the first word differently; trim or extend to fit
            length = len(tokenizer(" ".join(chosen))["input_ids"])
            if length == num_tokens:
                break
            if length > num_tokens:
                chosen = chosen[: len(chosen) - (length - num_tokens)]
            else:
                chosen += [rng.choice(words) for _ in range(num_tokens - length)]
        else:
            raise ValueError(f"could not build a text of exactly {num_tokens} tokens with this tokenizer")
        texts.append(" ".join(chosen))
    return texts


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _figures(num_texts: int, times: Sequence[float]) -> dict[str, Any]:
    median = statistics.median(times)
    return {"median_s": median, "sequences_per_s": num_texts / median, "times_s": list(times)}


class _SentenceTransformersRunner:
    """sentence-transformers' ``encode`` on the model directory, in one dtype at a time (float32 first)."""

    def __init__(self, model_dir: str, batch_size: int) -> None:
        import sentence_transformers
        from sentence_transformers import SentenceTransformer

        self.version = sentence_transformers.__version__
        self.model = SentenceTransformer(model_dir, device="cpu")
        self.batch_size = batch_size

    def to(self, dtype: str) -> None:
        import torch

        self.model.to(getattr(torch, dtype))

    def encode(self, texts: Sequence[str]) -> Any:
        return self.model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True,
                                 show_progress_bar=False)


def _min_cosine(a: Any, b: Any) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def _measure_length(args: argparse.Namespace, llm: Any, st: _SentenceTransformersRunner | None,
                    st_dtypes: Sequence[str], texts: list[str], dtype: str) -> dict[str, Any]:
    """tokenmill's (and the baseline's, per dtype) figures for one length, runs alternating; ``dtype`` is
    tokenmill's (its ratio to the baseline in the same dtype is given too)."""
    import numpy as np

    n = len(texts)
    embed = lambda: llm.embed(texts)  # noqa: E731
    result: dict[str, Any] = {}
    tm_times: list[float] = []
    base: dict[str, list[float]] = {d: [] for d in st_dtypes}
    if st is not None:  # agreement check on float32, and the first (untimed) call of each
        st.to("float32")
        ref = st.encode(texts)
        got = np.stack([o.outputs.embedding for o in llm.embed(texts)])
        result["min_cosine_vs_baseline_float32"] = _min_cosine(got, ref)
    for i in range(args.num_iters_warmup + args.num_iters):
        elapsed = _timed(embed)
        if i >= args.num_iters_warmup:
            tm_times.append(elapsed)
        for st_dtype in st_dtypes if st is not None else ():
            assert st is not None
            st.to(st_dtype)
            elapsed = _timed(lambda: st.encode(texts))
            if i >= args.num_iters_warmup:
                base[st_dtype].append(elapsed)
    result["tokenmill"] = _figures(n, tm_times)
    if st is not None:
        per_dtype = {d: _figures(n, t) for d, t in base.items()}
        best = max(per_dtype, key=lambda d: per_dtype[d]["sequences_per_s"])
        result["baseline"] = {"dtypes": per_dtype, "best_dtype": best, **per_dtype[best]}
        result["ratio_sequences_per_s"] = result["tokenmill"]["sequences_per_s"] / per_dtype[best]["sequences_per_s"]
        if dtype in per_dtype:
            result["ratio_same_dtype"] = result["tokenmill"]["sequences_per_s"] / per_dtype[dtype]["sequences_per_s"]
    return result


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tokenmill bench embed``; returns the exit code."""
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.entrypoints.llm import LLM

    if args.num_iters < 1 or args.num_iters_warmup < 0 or args.num_prompts < 1:
        raise SystemExit("tokenmill bench embed: error: --num-iters and --num-prompts must be >= 1 and "
                         "--num-iters-warmup >= 0")
    refuse_data_parallel(args, "embed")
    lengths = parse_lengths(args.input_len)
    st_dtypes = parse_dtypes(args.st_dtypes)
    engine = LLMEngine.from_engine_args(engine_args_from(args))
    try:
        mc = engine.model_config
        if mc.runner_type != "pooling":
            raise SystemExit(f"tokenmill bench embed: error: {mc.model} is served with the {mc.runner_type} runner; "
                             "pass an embedding model (or --runner pooling)")
        if max(lengths) > mc.max_model_len:
            raise SystemExit(f"tokenmill bench embed: error: --input-len {max(lengths)} exceeds the context length "
                             f"{mc.max_model_len}")
        llm = LLM.from_llm_engine(engine)
        st = None
        if args.baseline == "sentence-transformers":
            st = _SentenceTransformersRunner(mc.model, args.st_batch_size)
            print(f"sentence-transformers {st.version} baseline, dtypes {', '.join(st_dtypes)}, batch size "
                  f"{args.st_batch_size}", flush=True)
        per_length: dict[str, Any] = {}
        for length in lengths:
            texts = word_texts(engine.get_tokenizer(), args.num_prompts, length, seed=args.seed + length)
            print(f"{args.num_prompts} texts of {length} tokens ...", flush=True)
            per_length[str(length)] = _measure_length(args, llm, st, st_dtypes, texts, str(mc.dtype))
        info = {"model": mc.model, "served_model_name": mc.served_model_name, "dtype": mc.dtype,
                "max_model_len": mc.max_model_len, "platform": engine.engine_config.device_config.platform,
                "max_num_batched_tokens": engine.engine_config.scheduler_config.max_num_batched_tokens,
                "kernels": engine_kernel_info(engine)}
        st_version = st.version if st is not None else None
    finally:
        engine.shutdown()
        del engine
        gc.collect()
    record = base_record("embed", args)
    rss = peak_rss_bytes()
    record.update({"model": info["served_model_name"], "dtype": info["dtype"], "engine": info,
                   "lengths": per_length, "peak_rss_bytes": rss})
    rows: list[tuple[str, Any]] = [("Model", info["served_model_name"]), ("dtype", info["dtype"]),
                                   ("Texts per length x timed runs", f"{args.num_prompts} x {args.num_iters}")]
    if st_version is not None:
        record["baseline"] = {"name": "sentence-transformers", "version": st_version,
                              "batch_size": args.st_batch_size}
    for length, fig in per_length.items():
        rows.append((f"{length} tokens: tokenmill sequences/s", fig["tokenmill"]["sequences_per_s"]))
        if "baseline" in fig:
            for dtype, d in fig["baseline"]["dtypes"].items():
                rows.append((f"{length} tokens: sentence-transformers {dtype} sequences/s", d["sequences_per_s"]))
            rows.append((f"{length} tokens: ratio tokenmill / sentence-transformers, best dtype "
                         f"({fig['baseline']['best_dtype']})", fig["ratio_sequences_per_s"]))
            if "ratio_same_dtype" in fig:
                rows.append((f"{length} tokens: ratio tokenmill / sentence-transformers, both {info['dtype']}",
                             fig["ratio_same_dtype"]))
            rows.append((f"{length} tokens: lowest cosine vs sentence-transformers float32",
                         f"{fig['min_cosine_vs_baseline_float32']:.6f}"))
    rows.append(("Peak RSS (MiB)", rss / 2**20))
    rows += isa_rows(record, info["kernels"] or kernel_info())
    print_table("tokenmill bench embed", rows)
    if args.json:
        write_json(args.json, record)
    return 0
