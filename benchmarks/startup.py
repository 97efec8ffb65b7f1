"""Time `tokenmill serve` from process start to ready and to its first answer, cold and warm.

A cold start runs with empty ``TORCHINDUCTOR_CACHE_DIR``, ``TORCH_EXTENSIONS_DIR`` and ``TOKENMILL_CACHE_DIR``
(the directories are made under ``--cache-dir``, which is emptied first); the warm starts that follow reuse them,
after the cold server has logged "background compilation done" (or ``--compile-wait-s`` has passed).

Each start records: seconds until ``GET /v1/models`` answers (ready), seconds until an 8-token
``POST /v1/completions`` has answered (first answer, sent as soon as the server is ready), and the server's
log lines with their arrival time (seconds since start), so where the time went can be read off.

    python benchmarks/startup.py --warm-runs 2 --output benchmarks/results/<date>_<machine>_startup.json

The targets: first answer within 30 s cold and 15 s warm (docs/benchmarks.md, "Start-up").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any


def _get(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _complete(base: str, timeout: float = 600.0) -> str:
    body = json.dumps({"model": _model_name(base), "prompt": "The capital of France is", "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["choices"][0]["text"]


def _model_name(base: str) -> str:
    with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
        return json.loads(r.read())["data"][0]["id"]


def one_start(args: argparse.Namespace, env: dict[str, str], label: str) -> dict[str, Any]:
    """Start a server, time ready and first answer, optionally wait for background compilation, stop it."""
    base = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--port", str(args.port), *args.serve_args]
    lines: list[tuple[float, str]] = []
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((round(time.perf_counter() - start, 2), line.rstrip()))
            if "background compilation done" in line:
                done.set()

    threading.Thread(target=reader, daemon=True).start()
    ready = answer = None
    text = ""
    try:
        while proc.poll() is None and time.perf_counter() - start < 600:
            if _get(base + "/v1/models"):
                ready = time.perf_counter() - start
                break
            time.sleep(0.05)
        if ready is None:
            raise RuntimeError(f"{label}: server did not become ready; log tail: {lines[-10:]}")
        text = _complete(base)
        answer = time.perf_counter() - start
        if args.compile_wait_s > 0:
            done.wait(args.compile_wait_s)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    result = {"label": label, "ready_s": round(ready, 2), "first_answer_s": round(answer, 2), "text": text,
              "compile_done_s": next((t for t, l in lines if "background compilation done" in l), None),
              "log": [f"{t:7.2f} {l}" for t, l in lines]}
    print(f"{label}: ready {ready:.2f} s, first answer {answer:.2f} s ({text!r})", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", default="/tmp/tm-startup-cache", help="emptied first, then used by every start")
    parser.add_argument("--port", type=int, default=8303)
    parser.add_argument("--warm-runs", type=int, default=2)
    parser.add_argument("--no-cold", action="store_true", help="keep the cache directory (warm starts only)")
    parser.add_argument("--compile-wait-s", type=float, default=900.0,
                        help="after the cold start's first answer, wait this long for background compilation")
    parser.add_argument("--output", help="JSON file for the results")
    parser.add_argument("serve_args", nargs="*", help="extra `tokenmill serve` arguments (after --)")
    args = parser.parse_args()

    root = os.path.abspath(args.cache_dir)
    if not args.no_cold:
        shutil.rmtree(root, ignore_errors=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{root}/inductor", TORCH_EXTENSIONS_DIR=f"{root}/ext",
               TOKENMILL_CACHE_DIR=f"{root}/tm", PYTHONUNBUFFERED="1")
    runs = []
    if not args.no_cold:
        runs.append(one_start(args, env, "cold"))
    wait = args.compile_wait_s
    args.compile_wait_s = 0.0
    for i in range(args.warm_runs):
        runs.append(one_start(args, env, f"warm{i + 1}"))
    args.compile_wait_s = wait
    from tokenmill.entrypoints.bench.common import machine_info

    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info(),
           "serve_args": args.serve_args,
           "runs": runs}
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
