"""tokenmill against llama.cpp on a quantized GGUF at a real model's shape: decode, prefill, peak memory, start-up.

Issue 40's targets, on the random-weight files of ``benchmarks/gguf_random_model.py`` (Llama-3.2-1B or
Llama-3-8B shape, ``Q4_0`` or ``Q4_K_M``), both engines on the same file with the same thread count:

* single-stream decode tokens/s (``--decode-in`` tokens in, ``--decode-out`` out, greedy, EOS ignored:
  ``(out - 1) / (t_last - t_first)``) at least llama.cpp's;
* prefill of a ``--prefill-len`` token prompt (prompt tokens / time to the first token) at least llama.cpp's;
* peak resident size of the process (``ru_maxrss``, over its whole life) at most 1.2x llama.cpp's;
* time from process start to the first answer (an 8-token completion) at most 2x llama.cpp's load time
  (``llama_cpp.Llama(...)``) plus 10 s, on a warm machine (file in the page cache, tokenmill's compiled graphs
  in its on-disk cache: one untimed tokenmill process runs first).

Each engine runs in its own fresh process (``--rounds`` processes per engine, alternating, so that load from
other jobs on a shared machine hits both alike); each process answers once, then runs ``--warmup`` untimed and
``--iters`` timed prompts for prefill and for decode (medians per process). The prompts are the same random
token ids for both engines (drawn by this process with the file's tokenizer). tokenmill runs the offline engine
(``LLMEngine``, compiled graphs loaded before the first request, ``--quantization``); llama.cpp runs through
``llama-cpp-python`` with a context of ``--n-ctx`` tokens, which is also tokenmill's ``max_model_len``, and
tokenmill's KV cache is sized for the same number of tokens.

    nice -n 15 python benchmarks/llamacpp_targets.py --shape 1b --ftype Q4_K_M --rounds 3 \\
        --llamacpp-python /path/to/llama-venv/bin/python \\
        --json benchmarks/results/<date>_<machine>_llamacpp_targets/1b_q4_k_m.json

Figures: docs/benchmarks.md ("Quantized GGUF against llama.cpp at 1B and 8B").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ANSWER_PROMPT = "The capital of France is"
ANSWER_TOKENS = 8


def _rss_now_mib() -> dict[str, float]:
    """The process's resident size now, MiB: total, anonymous and file-backed (a memory map's pages)."""
    out = {}
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) / 1024
    return out


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _summary(runs: list[dict[str, Any]], warmup: int, key: str) -> dict[str, Any]:
    values = [r[key] for r in runs[warmup:] if r[key] is not None]
    return {"median": statistics.median(values) if values else None, "values": values}


def worker_tokenmill(spec: dict[str, Any], spawned: float) -> dict[str, Any]:
    """One tokenmill process: engine start, first answer, prefill and decode runs, peak RSS."""
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine_args import EngineArgs
    from tokenmill.entrypoints.bench.latency import tokenmill_run

    start = time.time()
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=spec["model"], dtype=spec["dtype"], quantization=spec["quantization"], max_model_len=spec["n_ctx"],
        kv_cache_memory=spec["kv_cache_memory"], kv_cache_dtype=spec["kv_cache_dtype"],
        enable_prefix_caching=False))
    ready = time.time()
    rss_ready = _rss_now_mib()
    try:
        answer = tokenmill_run(engine, ANSWER_TOKENS, True)(spec["answer"])
        first_answer = time.time()
        prefill_run = tokenmill_run(engine, 1, False)
        prefill = [prefill_run(p) for p in spec["prefill"]]
        decode_run = tokenmill_run(engine, spec["decode_out"], False)
        decode = [decode_run(p) for p in spec["decode"]]
        import torch

        threads = torch.get_num_threads()
    finally:
        engine.shutdown()
    return {"load_s": ready - start, "ready_s": ready - spawned, "first_answer_s": first_answer - spawned,
            "answer_ttft_s": answer["ttft_s"], "rss_ready_mib": rss_ready, "threads": threads,
            "prefill": prefill, "decode": decode}


def worker_llamacpp(spec: dict[str, Any], spawned: float) -> dict[str, Any]:
    """One llama.cpp process: the same figures. Nothing of tokenmill is imported here (it imports torch, which
    would add to the RSS); the runs time tokens as ``tokenmill.entrypoints.bench.llamacpp_baseline`` does."""
    import llama_cpp

    start = time.time()
    llm = llama_cpp.Llama(model_path=spec["model"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          n_ctx=spec["n_ctx"], seed=0, verbose=False)
    ready = time.time()
    rss_ready = _rss_now_mib()

    def run(prompt: list[int], output_len: int) -> dict[str, Any]:
        llm.reset()
        times: list[float] = []
        t0 = time.perf_counter()
        for _token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == output_len:
                break
        rate = (output_len - 1) / (times[-1] - times[0]) if output_len > 1 else None
        return {"ttft_s": times[0] - t0, "decode_tokens_per_s": rate}

    answer = run(spec["answer"], ANSWER_TOKENS)
    first_answer = time.time()
    prefill = [run(p, 1) for p in spec["prefill"]]
    decode = [run(p, spec["decode_out"]) for p in spec["decode"]]
    return {"load_s": ready - start, "ready_s": ready - spawned, "first_answer_s": first_answer - spawned,
            "answer_ttft_s": answer["ttft_s"], "rss_ready_mib": rss_ready, "threads": spec["threads"],
            "version": llama_cpp.__version__, "torch_imported": "torch" in sys.modules, "prefill": prefill,
            "decode": decode}


def run_worker(engine: str, spec_path: str, python: str = sys.executable) -> dict[str, Any]:
    """Start a fresh process for ``engine`` with interpreter ``python`` and return its figures (with its peak RSS).

    Raises:
        RuntimeError: the process failed (with the end of its stderr).
    """
    env = dict(os.environ)
    spawned = time.time()
    out = subprocess.run([python, os.path.abspath(__file__), "--worker", engine, "--spec", spec_path,
                          "--spawned", repr(spawned)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{engine} worker failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _kv_cache_bytes(model: str, n_ctx: int, dtype_bytes: int) -> int:
    """Bytes of a KV cache of ``n_ctx`` tokens (plus two 16-token blocks) for the GGUF file's shape."""
    import gguf

    reader = gguf.GGUFReader(model)

    def field(name: str) -> int:
        return int(reader.fields[f"llama.{name}"].contents())

    head_dim = field("embedding_length") // field("attention.head_count")
    per_token = 2 * field("block_count") * field("attention.head_count_kv") * head_dim * dtype_bytes
    return (n_ctx + 32) * per_token


def make_spec(args: argparse.Namespace, model: str) -> dict[str, Any]:
    from tokenmill.entrypoints.bench.common import load_tokenizer_for, random_prompts

    tokenizer = load_tokenizer_for(model)
    vocab = len(tokenizer)
    n = args.warmup + args.iters
    kv_bytes = 2 if args.kv_cache_dtype in ("bfloat16", "float16") else 4
    return {
        "model": model, "dtype": args.dtype, "quantization": args.quantization, "threads": args.threads,
        "n_ctx": args.n_ctx, "kv_cache_dtype": args.kv_cache_dtype,
        "kv_cache_memory": _kv_cache_bytes(model, args.n_ctx, kv_bytes),
        "answer": list(tokenizer.encode(ANSWER_PROMPT)),
        "prefill": random_prompts(tokenizer, n, args.prefill_len, seed=1, vocab_size=vocab),
        "decode": random_prompts(tokenizer, n, args.decode_in, seed=2, vocab_size=vocab),
        "decode_out": args.decode_out,
    }


def summarize_process(r: dict[str, Any], warmup: int, prefill_len: int) -> dict[str, Any]:
    prefill = _summary(r["prefill"], warmup, "ttft_s")
    decode = _summary(r["decode"], warmup, "decode_tokens_per_s")
    return {"load_s": r["load_s"], "first_answer_s": r["first_answer_s"], "peak_rss_mib": r["peak_rss_mib"],
            "rss_ready_mib": r["rss_ready_mib"],
            "prefill_tokens_per_s": prefill_len / prefill["median"] if prefill["median"] else None,
            "prefill_ttft_s": prefill["values"], "decode_tokens_per_s": decode["median"],
            "decode_values": decode["values"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=["tokenmill", "llamacpp"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--spawned", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--model", help="a GGUF file (default: the random file of --shape / --ftype, written first)")
    parser.add_argument("--shape", default="1b", choices=["1b", "8b"])
    parser.add_argument("--ftype", default="Q4_K_M", choices=["Q4_0", "Q4_K_M"])
    parser.add_argument("--dir", default="/tmp/tokenmill-gguf-bench", help="where the random files are written")
    parser.add_argument("--quantization", default="int4", choices=["int4", "int8"])
    parser.add_argument("--dtype", default="float32", help="tokenmill's activation dtype")
    parser.add_argument("--kv-cache-dtype", default="auto", help="tokenmill's KV cache dtype")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: usable cores, "
                                                                     "which is what tokenmill uses)")
    parser.add_argument("--n-ctx", type=int, default=1024)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--decode-in", type=int, default=128)
    parser.add_argument("--decode-out", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=1, help="untimed prompts per process and measurement")
    parser.add_argument("--iters", type=int, default=3, help="timed prompts per process and measurement")
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per engine, alternating")
    parser.add_argument("--engines", default="tokenmill,llamacpp")
    parser.add_argument("--no-warm-start", action="store_true",
                        help="skip the untimed tokenmill process that fills the compile cache")
    parser.add_argument("--json", help="write the record here")
    parser.add_argument("--llamacpp-python", default=sys.executable,
                        help="interpreter of the llama.cpp processes (a venv with llama-cpp-python; default: this "
                        "one). Putting another venv's site-packages on PYTHONPATH instead would shadow tokenmill")
    args = parser.parse_args()

    if args.worker:
        with open(args.spec, encoding="utf-8") as f:
            spec = json.load(f)
        figures = (worker_tokenmill if args.worker == "tokenmill" else worker_llamacpp)(spec, args.spawned)
        figures["peak_rss_mib"] = _peak_rss_mib()
        figures["rss_end_mib"] = _rss_now_mib()
        figures["children_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        print(json.dumps(figures))
        return

    from gguf_random_model import ensure_model  # benchmarks/gguf_random_model.py: this script's folder is on sys.path
    from tokenmill.entrypoints.bench.common import cpu_steal_seconds, machine_info, usable_cores

    args.threads = args.threads or usable_cores()
    model = args.model or ensure_model(args.dir, args.shape, args.ftype)
    spec = make_spec(args, model)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    record: dict[str, Any] = {"benchmark": "llamacpp_targets", "command": " ".join(sys.argv),
                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "machine": machine_info(), "model": model,
                              "file_mib": os.path.getsize(model) / 2**20,
                              "args": {k: v for k, v in vars(args).items() if k not in ("worker", "spec", "spawned")},
                              "processes": {e: [] for e in engines}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        spec_path = f.name
    try:
        if "tokenmill" in engines and not args.no_warm_start:
            print("untimed tokenmill start (page cache, compile cache) ...", flush=True)
            small = dict(spec, prefill=spec["prefill"][:1], decode=spec["decode"][:1])
            with open(spec_path + ".warm", "w", encoding="utf-8") as g:
                json.dump(small, g)
            run_worker("tokenmill", spec_path + ".warm")
        for rnd in range(args.rounds):
            order = engines if rnd % 2 == 0 else engines[::-1]
            for engine in order:
                steal = cpu_steal_seconds()
                raw = run_worker(engine, spec_path, args.llamacpp_python if engine == "llamacpp" else sys.executable)
                s = summarize_process(raw, args.warmup, args.prefill_len)
                s["cpu_steal_s"] = (cpu_steal_seconds() or 0.0) - (steal or 0.0) if steal is not None else None
                s["raw"] = raw
                record["processes"][engine].append(s)
                print(f"round {rnd + 1} {engine:<10} decode {s['decode_tokens_per_s']:.2f} tok/s, prefill "
                      f"{s['prefill_tokens_per_s']:.1f} tok/s, peak RSS {s['peak_rss_mib']:.0f} MiB, load "
                      f"{s['load_s']:.2f} s, first answer {s['first_answer_s']:.2f} s", flush=True)
    finally:
        os.unlink(spec_path)
        if os.path.exists(spec_path + ".warm"):
            os.unlink(spec_path + ".warm")
    record["summary"] = summarize(record["processes"])
    print_summary(record)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        print(f"record written to {args.json}")


def summarize(processes: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per engine the median over processes (and min / max) of each figure; the targets where both ran."""
    keys = ("decode_tokens_per_s", "prefill_tokens_per_s", "peak_rss_mib", "load_s", "first_answer_s")
    out: dict[str, Any] = {}
    for engine, procs in processes.items():
        out[engine] = {k: {"median": statistics.median(p[k] for p in procs), "min": min(p[k] for p in procs),
                           "max": max(p[k] for p in procs)} for k in keys if procs}
    if out.get("tokenmill") and out.get("llamacpp"):
        t, c = out["tokenmill"], out["llamacpp"]
        out["targets"] = {
            "decode_ratio": t["decode_tokens_per_s"]["median"] / c["decode_tokens_per_s"]["median"],
            "prefill_ratio": t["prefill_tokens_per_s"]["median"] / c["prefill_tokens_per_s"]["median"],
            "peak_rss_ratio": t["peak_rss_mib"]["median"] / c["peak_rss_mib"]["median"],
            "first_answer_s": t["first_answer_s"]["median"],
            "first_answer_bound_s": 2 * c["load_s"]["median"] + 10,
        }
        tg = out["targets"]
        tg["met"] = {"decode": tg["decode_ratio"] >= 1, "prefill": tg["prefill_ratio"] >= 1,
                     "peak_rss": tg["peak_rss_ratio"] <= 1.2, "start": tg["first_answer_s"] <= tg["first_answer_bound_s"]}
    return out


def print_summary(record: dict[str, Any]) -> None:
    s = record["summary"]
    print(f"\n{record['model']} ({record['file_mib']:.0f} MiB), medians over processes [min-max]:")
    for engine in record["processes"]:
        if engine not in s:
            continue
        row = "  ".join(f"{k} {v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]" for k, v in s[engine].items())
        print(f"  {engine:<10} {row}")
    if "targets" in s:
        print("  targets:", json.dumps(s["targets"]))


if __name__ == "__main__":
    main()
