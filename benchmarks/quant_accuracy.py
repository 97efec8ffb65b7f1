"""Accuracy of each quantized checkpoint format against the float32 model: greedy agreement and the mean KL
divergence of next-token distributions.

Usage (the tables in docs/quantization.md, "Accuracy by format" and "Quantized KV cache"):

    nice -n 15 python benchmarks/quant_accuracy.py --json benchmarks/results/<date>_<machine>_quant_accuracy.json
    nice -n 15 python benchmarks/quant_accuracy.py --kv-cache --embedded --json ...

For each method a model is written and run next to its float32 reference, every engine in this process
(``EngineCore``, float32 activations, eager):

* tiny random Llamas (``--hidden``, ``--layers``; vocabulary 512), written by the tests' writers
  (``tests/models/*_writer.py``: the formats' documented layouts) from one random float model, which is the
  reference: AWQ, GPTQ 4/8-bit, compressed-tensors (pack-quantized W4A16 / W8A16, int-quantized W8A8,
  float-quantized FP8), FP8 (per-tensor, block-wise), and GGUF files of the same model (``gguf.quants``):
  ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, ``Q8_0`` loaded with ``-q``, and the ``F32`` file quantized at load with
  ``-q int8`` / ``-q int4``;
* with ``--embedded``, the embedded default model (SmolLM2-135M-Instruct, a ``Q4_1``/``Q8_0`` GGUF) with
  ``-q int8`` / ``-q int4`` against its float32 (dequantized) load, on English prompts;
* with ``--kv-cache``, instead of the formats: the float models (the tiny one, and with ``--embedded`` the
  embedded one) with a quantized KV cache (``--kv-cache-dtype int8``, ``fp8_e4m3``, ``fp8_e5m2``, and
  ``bfloat16`` for comparison) against the same model with its float32 cache.

Figures, per method: the share of prompts whose free-running greedy tokens equal the reference's, the mean
number of leading tokens that agree, and, with the method's model forced along the reference's greedy tokens (a
logits processor), the share of positions whose argmax equals the reference's and the mean
``KL(reference || method)`` of the next-token distributions over all positions. Random weights give nearly flat
distributions, so their KL values compare formats with each other, not with real models.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the tests' checkpoint writers

from tokenmill.engine.core import EngineCore  # noqa: E402
from tokenmill.engine.messages import EngineCoreRequest  # noqa: E402
from tokenmill.engine_args import EngineArgs  # noqa: E402
from tokenmill.entrypoints.bench.common import base_record, write_json  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402
from tokenmill.worker.logits_processor import LogitsProcessor, LogitsProcessorBatch  # noqa: E402

RECORDED: dict[str, list[torch.Tensor]] = {}  # request id -> log-probabilities [vocab] per generated position

KV_CACHE_DTYPES = ["bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"]  # --kv-cache
ENGLISH = ["The capital of France is", "Photosynthesis is the process by which", "Here is a haiku about the sea:",
           "To reverse a list in Python, you", "The sky is blue because", "A CPU cache is", "Once upon a time,",
           "The three laws of motion are"]


class Recorder(LogitsProcessor):
    """Keeps each sampled row's log-probabilities; a request with ``extra_args["force"]`` (token ids) samples
    those tokens instead (every other logit set to ``-inf``)."""

    def apply(self, logits: torch.Tensor, batch: LogitsProcessorBatch) -> torch.Tensor:
        for i, (rid, params, out) in enumerate(zip(batch.req_ids, batch.sampling_params, batch.output_token_ids)):
            RECORDED.setdefault(rid, []).append(torch.log_softmax(logits[i].float(), -1).cpu())
            force = (params.extra_args or {}).get("force")
            if force is not None:
                row = torch.full_like(logits[i], float("-inf"))
                row[force[len(out)]] = 0
                logits[i] = row
        return logits


def run(path: str, quantization: str | None, prompts: list[list[int]], max_tokens: int,
        forced: list[list[int]] | None = None, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """Greedy tokens of ``prompts`` (``tokens``) and, with ``forced``, the log-probabilities along those
    sequences (``forced_logprobs``, ``[max_tokens, vocab]`` per prompt; without: along its own tokens)."""
    config = EngineArgs(model=path, dtype="float32", quantization=quantization, num_gpu_blocks_override=512,
                        enforce_eager=True, logits_processors=[Recorder],
                        kv_cache_dtype=kv_cache_dtype).create_engine_config()
    core = EngineCore(config)
    tag = f"{time.monotonic_ns()}"
    requests = [EngineCoreRequest(f"{tag}-free-{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                         ignore_eos=True)) for i, p in enumerate(prompts)]
    for i, (p, f) in enumerate(zip(prompts, forced or [])):
        requests.append(EngineCoreRequest(f"{tag}-forced-{i}", p, SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args={"force": f})))
    for r in requests:
        core.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            tokens[o.request_id].extend(o.new_token_ids)
    kind = "forced" if forced else "free"
    result = {"tokens": [tokens[f"{tag}-free-{i}"] for i in range(len(prompts))],
              "forced_logprobs": [torch.stack(RECORDED.pop(f"{tag}-{kind}-{i}")) for i in range(len(prompts))]}
    for r in requests:
        RECORDED.pop(r.request_id, None)
    core.shutdown()
    del core
    gc.collect()
    return result


def compare(ref: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    """Greedy agreement and KL figures of ``other`` against ``ref`` (module docstring)."""
    leading, identical = [], 0
    for a, b in zip(ref["tokens"], other["tokens"]):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        leading.append(n)
        identical += a == b
    kls, top1 = [], []
    for p, q in zip(ref["forced_logprobs"], other["forced_logprobs"]):
        kls.append((p.exp() * (p - q)).sum(-1))
        top1.append(p.argmax(-1) == q.argmax(-1))
    kl, agree = torch.cat(kls), torch.cat(top1).float()
    return {"identical_share": identical / len(ref["tokens"]), "mean_leading_tokens": sum(leading) / len(leading),
            "top1_agreement": float(agree.mean()), "mean_kl": float(kl.mean()), "max_kl": float(kl.max())}


def tiny_methods(folder: str, hidden: int, layers: int) -> tuple[str, list[tuple[str, str, str | None]]]:
    """The random float model and ``(name, checkpoint, --quantization)`` of every Hugging Face format."""
    from tests.conftest import build_tiny_llama
    from tests.models.hf_quant_writer import Case, write_checkpoints
    from tests.models.scaled_quant_writer import ScaledCase, write_scaled_checkpoints

    base = build_tiny_llama(os.path.join(folder, "base"), hidden_size=hidden, intermediate_size=hidden * 2,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    cases: list[tuple[str, Any]] = [
        ("AWQ 4-bit g128", Case("awq", 4, 128)), ("GPTQ 4-bit g128", Case("gptq", 4, 128)),
        ("GPTQ 8-bit g128", Case("gptq", 8, 128)),
        ("compressed-tensors W4A16 g128 sym", ScaledCase("pack", 4, 128)),
        ("compressed-tensors W4A16 g128 asym", ScaledCase("pack", 4, 128, symmetric=False)),
        ("compressed-tensors W8A16 channel", ScaledCase("pack", 8, 0)),
        ("compressed-tensors W8A8 int8 channel", ScaledCase("int", 8, 0)),
        ("compressed-tensors FP8 channel", ScaledCase("ct-fp8")),
        ("FP8 per-tensor", ScaledCase("fp8")), ("FP8 block 128x128", ScaledCase("fp8", block=(128, 128))),
    ]
    out = []
    for i, (name, case) in enumerate(cases):
        sub = os.path.join(folder, f"m{i}")
        if isinstance(case, Case):
            qdir = write_checkpoints(sub, case, seed=i, base=base)[0]
        else:
            qdir = write_scaled_checkpoints(sub, case, base)[0]
        out.append((name, qdir, None))
    return base, out


def gguf_methods(folder: str, base: str) -> list[tuple[str, str, str | None]]:
    """``(name, file, --quantization)`` of the Hugging Face model ``base`` written as GGUF files
    (``gguf.quants``), and its ``F32`` file quantized at load."""
    import gguf

    from tests.models.gguf_writer import write_gguf

    t = gguf.GGMLQuantizationType
    f32 = write_gguf(base, os.path.join(folder, "F32.gguf"), "llama")
    out = [("GGUF F32 -q int8", f32, "int8"), ("GGUF F32 -q int4", f32, "int4")]
    for qtype, method in ((t.Q4_0, "int4"), (t.Q4_1, "int4"), (t.Q5_0, "int8"), (t.Q5_1, "int8"), (t.Q8_0, "int8")):
        path = write_gguf(base, os.path.join(folder, f"{qtype.name}.gguf"), "llama", qtype=qtype)
        out.append((f"GGUF {qtype.name} -q {method}", path, method))
    return out


def measure(label: str, ref_path: str, methods: list[tuple[str, str, str | None]], prompts: list[list[int]],
            max_tokens: int, kv_cache_dtypes: list[str] | None = None) -> list[dict[str, Any]]:
    """Every method against ``ref_path``'s float32 model; with ``kv_cache_dtypes``, those KV-cache dtypes of the
    reference model instead (``methods`` unused)."""
    ref = run(ref_path, None, prompts, max_tokens)
    rows = []
    if kv_cache_dtypes is not None:
        methods = [(f"--kv-cache-dtype {d}", ref_path, None, d) for d in kv_cache_dtypes]
    for name, path, quantization, *kv in methods:
        start = time.perf_counter()
        got = run(path, quantization, prompts, max_tokens, forced=ref["tokens"], kv_cache_dtype=(kv or ["auto"])[0])
        row = {"model": label, "method": name, **compare(ref, got), "seconds": round(time.perf_counter() - start, 1)}
        print(f"{label:9s} {name:40s} identical {row['identical_share']:.2f}  leading {row['mean_leading_tokens']:5.1f}"
              f"  top-1 {row['top1_agreement']:.3f}  KL {row['mean_kl']:.2e} (max {row['max_kl']:.2e})", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256, help="tiny models' hidden size (intermediate: twice)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--embedded", action="store_true", help="also the embedded default model with -q int8 / int4")
    p.add_argument("--kv-cache", action="store_true",
                   help="measure quantized KV caches of the float models instead of the weight formats")
    p.add_argument("--json", default=None, help="write the record here")
    args = p.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 40, (args.prompts,), generator=gen)]
    rows: list[dict[str, Any]] = []
    kv = KV_CACHE_DTYPES if args.kv_cache else None
    with tempfile.TemporaryDirectory() as folder:
        if kv:
            from tests.conftest import build_tiny_llama

            base = build_tiny_llama(os.path.join(folder, "base"), hidden_size=args.hidden,
                                    intermediate_size=args.hidden * 2, num_hidden_layers=args.layers,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
            rows += measure("tiny", base, [], prompts, args.max_tokens, kv)
        else:
            base, hf = tiny_methods(os.path.join(folder, "hf"), args.hidden, args.layers)
            os.makedirs(os.path.join(folder, "gguf"))
            rows += measure("tiny", base, hf + gguf_methods(os.path.join(folder, "gguf"), base), prompts,
                            args.max_tokens)
    if args.embedded:
        from transformers import AutoTokenizer

        from tokenmill.model_loader.default_model import default_model_path

        path = default_model_path()
        tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        english = [tok.encode(s) for s in ENGLISH[:args.prompts]]
        rows += measure("embedded", path, [("-q int8", path, "int8"), ("-q int4", path, "int4")], english,
                        args.max_tokens, kv)
    if args.json:
        record = base_record("quant_accuracy", args)
        record["results"] = rows
        write_json(args.json, record)


if __name__ == "__main__":
    main()
