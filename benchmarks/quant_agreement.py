"""Greedy agreement of a weight-quantized engine with the full-precision (dequantized) one on a fixed test set.

Usage (the figures in docs/benchmarks.md, "Quantized matmul kernels"):

    python benchmarks/quant_agreement.py --quantization int4 --dtype bfloat16 --max-tokens 64 \
        --json benchmarks/results/<date>_<machine>_quant_agreement_int4.json

Runs the same chat questions (the test set below, answered with the model's chat template, temperature 0)
through three engines, one after the other: the reference (float32, no quantization: the checkpoint's weights
as loaded, dequantized for a GGUF file), ``--dtype`` without quantization (the noise floor: what the lower
activation precision alone changes) and ``--dtype`` with ``--quantization``. Each is compared with the
reference by its generated token ids: the share of answers that are identical, the mean number of leading
tokens that agree before the first divergence, and the share of all reference tokens reproduced before a
divergence. Greedy decoding makes any early difference change everything after it, so the leading-token
figures are the meaningful ones. The first token comes from the prefill step, which uses the full-precision
weights whenever the prompt is longer than the quantized layers' row limit (32 rows).
"""

from __future__ import annotations

import argparse
import gc
import statistics

from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.bench.common import base_record, write_json

TEST_SET = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 10.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does a CPU cache do?",
    "Translate 'good morning' into Spanish.",
    "Summarize the plot of Romeo and Juliet.",
    "What is 17 times 23?",
    "Name the planets of the solar system.",
    "Describe a cat to someone who has never seen one.",
    "What is the difference between weather and climate?",
    "Suggest a name for a bakery.",
    "How does a bicycle stay upright?",
    "Write one sentence about autumn.",
    "What are the benefits of regular exercise?",
    "Explain what an API is to a child.",
    "Who wrote 'Pride and Prejudice'?",
    "What is machine learning?",
    "Give two tips for better sleep.",
    "What is the boiling point of water at sea level?",
    "Write a polite email opening line.",
]


def generate(model: str | None, dtype: str, quantization: str | None, args: argparse.Namespace) -> list[list[int]]:
    llm = LLM(model, dtype=dtype, quantization=quantization, max_model_len=1024, kv_cache_memory="1GiB")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    outs = llm.chat([[{"role": "user", "content": q}] for q in TEST_SET], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    return tokens


def leading_agreement(ref: list[int], other: list[int]) -> int:
    """Number of leading positions where the two token sequences agree."""
    n = 0
    for a, b in zip(ref, other):
        if a != b:
            break
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    p.add_argument("--quantization", default="int4", choices=["int8", "int4"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", default=None, help="write the figures and per-question results here")
    args = p.parse_args()
    reference = generate(args.model, "float32", None, args)
    runs = {
        f"{args.dtype}": generate(args.model, args.dtype, None, args),
        f"{args.dtype}+{args.quantization}": generate(args.model, args.dtype, args.quantization, args),
    }
    total_ref = sum(len(r) for r in reference)
    figures: dict[str, dict[str, float | int]] = {}
    for name, tokens in runs.items():
        leading = [leading_agreement(r, q) for r, q in zip(reference, tokens)]
        identical = sum(r == q for r, q in zip(reference, tokens))
        figures[name] = {
            "identical_answers": identical,
            "identical_share": identical / len(TEST_SET),
            "mean_leading_agreement_tokens": statistics.mean(leading),
            "median_leading_agreement_tokens": statistics.median(leading),
            "tokens_before_divergence_share": sum(leading) / total_ref,
        }
    print(f"greedy agreement with float32 (no quantization), {len(TEST_SET)} questions, "
          f"{args.max_tokens} tokens each ({total_ref} reference tokens):")
    print(f"  {'run':24s} {'identical':>10s} {'mean lead':>10s} {'median lead':>12s} {'share':>8s}")
    for name, f in figures.items():
        print(f"  {name:24s} {f['identical_answers']:>10d} {f['mean_leading_agreement_tokens']:>10.1f} "
              f"{f['median_leading_agreement_tokens']:>12.1f} {f['tokens_before_divergence_share']:>8.3f}")
    if args.json:
        record = base_record("quant_agreement", args)
        record.update(figures=figures, reference=reference, runs=runs)
        write_json(args.json, record)


if __name__ == "__main__":
    main()
