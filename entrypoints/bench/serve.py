"""``tokenmill bench serve``: load against any OpenAI-compatible server's streaming ``/v1/completions``.

Prompts are random token ids (so each is exactly I tokens, whatever the tokenizer would do with text) and each
request asks for exactly O tokens (``max_tokens = min_tokens = O``, ``ignore_eos``). Requests start all at once
(bounded by ``--max-concurrency``) or, with ``--request-rate``, at Poisson-distributed times. Only the given
URL is contacted; the command ends when every request has finished or failed.

Per request: TTFT (send to first streamed token), ITL (gaps between streamed chunks), TPOT
(``(E2E - TTFT) / (output tokens - 1)``) and E2E latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.entrypoints.bench.common import (
    add_shared_args,
    base_record,
    isa_rows,
    load_tokenizer_for,
    print_table,
    random_prompts,
    summarize,
    write_json,
)


@dataclass
class RequestResult:
    """One request's outcome; times in seconds (``time.perf_counter()`` differences)."""

    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="Load-test an OpenAI-compatible server (/v1/completions, streaming).",
        description="Send N streaming completion requests to a running OpenAI-compatible server and report "
                    "throughput and TTFT / TPOT / ITL / E2E latency (mean, p50, p99).",
    )
    parser.add_argument("--base-url", required=True, help="Server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions", help="Path of the completions route.")
    parser.add_argument("--model", default=None, help="Model name to send (default: the first of /v1/models).")
    parser.add_argument("--tokenizer", default=None,
                        help="Tokenizer for the random prompts: model directory, .gguf file or hub id "
                             "(default: the embedded SmolLM2 model's).")
    add_shared_args(parser, num_prompts=256, num_prompts_help="Requests to send", tqdm=True)
    parser.add_argument("--max-concurrency", type=int, default=32, help="Most requests in flight (default 32).")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="Mean requests/s of Poisson arrivals (default: all at once).")
    parser.add_argument("--api-key", default=None, help="Sent as 'Authorization: Bearer KEY'.")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="Seconds per request (default 600).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of prompts and arrival times.")
    parser.set_defaults(func=run)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _model_name(client: Any, base_url: str, api_key: str | None) -> str:
    resp = await client.get(f"{base_url}/v1/models", headers=_headers(api_key))
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


async def send_request(client: Any, url: str, payload: dict[str, Any], headers: dict[str, str]) -> RequestResult:
    """Stream one completion; never raises (failures come back with ``ok=False`` and the error text)."""
    result = RequestResult(prompt_len=len(payload["prompt"]))
    chunks = 0
    usage_tokens: int | None = None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"stream error: {event['error']}"
                    return result
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                if any(c.get("text") for c in event.get("choices") or []):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
    except Exception as exc:  # noqa: BLE001 - one failed request must not end the benchmark
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens streamed"
    return result


def arrival_delays(num: int, rate: float | None, seed: int) -> list[float]:
    """Start times (seconds from the beginning) of ``num`` requests: all 0 without a rate, else a Poisson
    process of ``rate`` requests/s (exponential gaps, seeded)."""
    if rate is None or rate <= 0 or rate == float("inf"):
        return [0.0] * num
    import numpy as np

    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


async def run_load(args: argparse.Namespace, prompts: Sequence[Sequence[int]],
                   transport: Any = None) -> tuple[list[RequestResult], float, str]:
    """Send every prompt; returns the results (in prompt order), the duration in seconds and the model name."""
    import httpx
    from tqdm.auto import tqdm

    base_url = args.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport) as client:
        model = args.model or await _model_name(client, base_url, args.api_key)
        url = base_url + args.endpoint
        headers = _headers(args.api_key)
        semaphore = asyncio.Semaphore(args.max_concurrency)
        bar = tqdm(total=len(prompts), desc="Requests", disable=args.disable_tqdm, dynamic_ncols=True)
        start = time.perf_counter()

        async def one(prompt: Sequence[int], delay: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            payload = {"model": model, "prompt": list(prompt), "max_tokens": args.output_len,
                       "min_tokens": args.output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}}
            async with semaphore:
                res = await send_request(client, url, payload, headers)
            bar.update(1)
            return res

        delays = arrival_delays(len(prompts), args.request_rate, args.seed)
        results = await asyncio.gather(*(one(p, d) for p, d in zip(prompts, delays)))
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration, model


def metrics(results: Sequence[RequestResult], duration: float, output_len: int) -> dict[str, Any]:
    """Throughputs (per second of ``duration``) and latency summaries in milliseconds."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    ms = 1000.0
    return {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "output_len_mismatches": sum(1 for r in ok if r.output_tokens != output_len),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": summarize([r.ttft * ms for r in ok]),
        "tpot_ms": summarize([t * ms for t in tpot]),
        "itl_ms": summarize([x * ms for r in ok for x in r.itl]),
        "e2e_latency_ms": summarize([r.e2e * ms for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }


def run(args: argparse.Namespace, transport: Any = None) -> int:
    """Entry point of ``tokenmill bench serve``; returns 1 when any request failed."""
    if args.num_prompts < 1 or args.max_concurrency < 1:
        raise SystemExit("tokenmill bench serve: error: --num-prompts and --max-concurrency must be >= 1")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    tokenizer = load_tokenizer_for(args.tokenizer)
    prompts = random_prompts(tokenizer, args.num_prompts, args.input_len, seed=args.seed)
    results, duration, model = asyncio.run(run_load(args, prompts, transport))
    m = metrics(results, duration, args.output_len)
    rows: list[tuple[str, Any]] = [
        ("Model", model),
        ("Successful requests", m["successful_requests"]),
        ("Failed requests", m["failed_requests"]),
        ("Max concurrency", args.max_concurrency),
        ("Request rate (req/s)", args.request_rate if args.request_rate else "inf"),
        ("Duration (s)", m["duration_s"]),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total output tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", m["request_throughput"]),
        ("Output throughput (tok/s)", m["output_throughput"]),
        ("Total token throughput (tok/s)", m["total_token_throughput"]),
    ]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_latency_ms", "E2E")):
        for stat in ("mean", "p50", "p99"):
            rows.append((f"{label} {stat} (ms)", m[key][stat]))
    record = base_record("serve", args)
    record.update({"model": model, "dtype": None, "server": args.base_url, **m})
    rows += isa_rows(record, None)  # this machine's; the server's kernels are not visible from here
    print_table("tokenmill bench serve", rows)
    for error in m["errors"]:
        print(f"error: {error}")
    if m["output_len_mismatches"]:
        print(f"warning: {m['output_len_mismatches']} requests did not return exactly {args.output_len} tokens")
    if args.json:
        write_json(args.json, record)
    return 1 if m["failed_requests"] else 0
