"""Load time and peak memory of a quantized GGUF: a Llama-3.2-1B-shaped file with random weights.

Writes (once, under ``--dir``) a Llama with Llama-3.2-1B's shape (16 layers, hidden 2048, MLP 8192, 32 query and
8 key/value heads, tied embeddings) whose 2-D tensors are ``--qtype`` (``gguf.quants.quantize`` of Gaussian
weights), with SmolLM2's tokenizer copied from the embedded default model (so the vocabulary is 49152, not
Llama 3's 128256). Then, each in a fresh process, loads it:

* ``tokenmill``: the engine's model loader with ``--quantization`` (``get_model``: the weights as the engine
  core gets them, before the KV cache is allocated), timed from the call and with the process's peak resident
  size (``ru_maxrss``) before and after;
* with ``--float-baseline``, the same without ``--quantization`` (float32 weights, as every GGUF load was before
  weights stayed quantized);
* ``llama.cpp`` (when ``llama_cpp`` imports): ``llama_cpp.Llama(path, n_ctx=512)``, the same figures.

    nice -n 15 python benchmarks/gguf_load.py --json $(benchmarks/record_name.sh gguf_load).json

Figures and their history: docs/quantization.md ("Memory").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from typing import Any

_TOKENMILL = """
import json, resource, sys, time, torch
from tokenmill.engine_args import EngineArgs
from tokenmill.model_loader.loader import get_model
quantization = None if sys.argv[2] == "none" else sys.argv[2]
config = EngineArgs(model=sys.argv[1], dtype="float32", quantization=quantization).create_engine_config()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
model = get_model(config.model_config, torch.device("cpu"))
seconds = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"load_s": seconds, "peak_rss_before_mib": before / 1024, "peak_rss_mib": after / 1024}))
"""

_LLAMA_CPP = """
import json, resource, sys, time
import llama_cpp
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
llm = llama_cpp.Llama(sys.argv[1], n_ctx=512, n_threads=2, verbose=False)
seconds = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"load_s": seconds, "peak_rss_before_mib": before / 1024, "peak_rss_mib": after / 1024}))
"""


def write_model(path: str, qtype_name: str, seed: int = 0) -> None:
    """The random 1B-shaped GGUF (module docstring), one float tensor in memory at a time."""
    import gguf
    import numpy as np

    from gguf_random_model import open_writer  # benchmarks/gguf_random_model.py: this script's folder is on sys.path

    qtype = gguf.GGMLQuantizationType[qtype_name]
    w, s = open_writer(path, "1b")
    vocab, h, f = s["vocab"], s["hidden"], s["intermediate"]
    head_dim = h // s["heads"]
    rng = np.random.default_rng(seed)

    def add(name: str, shape: tuple[int, ...], std: float) -> None:
        array = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, h), 0.02)
    kv = s["kv_heads"] * head_dim
    for i in range(s["layers"]):
        for part, shape in (("attn_q", (h, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)),
                            ("attn_output", (h, h)), ("ffn_gate", (f, h)), ("ffn_up", (f, h)), ("ffn_down", (h, f))):
            add(f"blk.{i}.{part}.weight", shape, 0.02)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def run(code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/tokenmill-gguf-bench", help="where the GGUF file is written (kept)")
    parser.add_argument("--qtype", default="Q4_0", choices=["Q4_0", "Q4_1", "Q8_0", "Q5_0"])
    parser.add_argument("--quantization", default="int4", choices=["int4", "int8"])
    parser.add_argument("--runs", type=int, default=2, help="loads per engine (the file is in the page cache)")
    parser.add_argument("--float-baseline", action="store_true",
                        help="also load without --quantization (float32 weights: ~4.7 GiB for the 1B shape), the "
                             "path every GGUF load took before weights stayed quantized")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"llama-3.2-1b-shape-random.{args.qtype}.gguf")
    if not os.path.exists(path):
        start = time.perf_counter()
        write_model(path + ".tmp", args.qtype)
        os.replace(path + ".tmp", path)
        print(f"wrote {path} in {time.perf_counter() - start:.0f} s")
    size_mib = os.path.getsize(path) / 2**20
    run(_TOKENMILL, path, args.quantization)  # fills the config/tokenizer cache: not part of a load
    results: dict[str, list[dict[str, Any]]] = {"tokenmill": [run(_TOKENMILL, path, args.quantization)
                                                              for _ in range(args.runs)]}
    if args.float_baseline:
        results["tokenmill float32"] = [run(_TOKENMILL, path, "none") for _ in range(args.runs)]
    try:
        import llama_cpp  # noqa: F401

        results["llama.cpp"] = [run(_LLAMA_CPP, path) for _ in range(args.runs)]
    except ImportError:
        results["llama.cpp"] = [{"error": "llama_cpp is not installed"}]
    print(f"file: {size_mib:.0f} MiB ({args.qtype}); tokenmill --quantization {args.quantization}")
    print(f"{'engine':<18} {'load s':>8} {'peak RSS MiB':>13} {'grown MiB':>10} {'grown / file':>13}")
    for engine, runs in results.items():
        for r in runs:
            if "error" in r:
                print(f"{engine:<18} {r['error']}")
                continue
            grown = r["peak_rss_mib"] - r["peak_rss_before_mib"]
            print(f"{engine:<18} {r['load_s']:>8.2f} {r['peak_rss_mib']:>13.0f} {grown:>10.0f} {grown / size_mib:>13.2f}")
    if args.json:
        record = {"command": " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
                  "file": {"path": path, "qtype": args.qtype, "size_mib": size_mib}, "results": results}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
