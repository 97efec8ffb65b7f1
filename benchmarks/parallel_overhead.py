"""Per-step cost of tensor and pipeline parallelism on a tiny model, where compute is negligible and a step's
time is almost all coordination: scheduler -> executor -> workers -> collectives / stage hand-off -> back.

For each layout (one rank in-process; TP=2 and PP=2 with local processes; the same on Ray unless
``--no-ray``) it builds an engine core on a random tiny Llama (hidden 64, 4 layers, float32), runs ``--batch``
requests of ``--output-len`` greedy tokens after a warm-up, and reports the median decode-step time
(``EngineCore.step`` calls that produced tokens) and the generated tokens per second. The per-step overhead of
a layout is its median step time minus the single-rank one. It also times the raw collectives inside the
workers (an all-reduce of one step's activations, ``[batch, 64]`` float32, over gloo; for PP a send/recv of
the same between the stages) so the step overhead can be split into communication and RPC.

    python benchmarks/parallel_overhead.py --json benchmarks/results/<date>_<machine>_parallel_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TOKENMILL_COMPILE", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _build_model(path: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def _time_collectives(worker, batch: int, iters: int) -> dict:
    """Median seconds of one all-reduce (TP group) and one stage send/recv (PP group), in a worker."""
    import torch

    from tokenmill.distributed import get_pp_group, get_tp_group

    out = {}
    x = torch.randn(batch, 64)
    tp, pp = get_tp_group(), get_pp_group()
    if tp.world_size > 1:
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            tp.all_reduce(x)
            times.append(time.perf_counter() - start)
        out["all_reduce_s"] = statistics.median(times)
    if pp.world_size > 1:
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            if pp.is_first_rank:
                pp.send_tensor_dict({"h": x})
                pp.recv_tensor_dict({"h": torch.empty_like(x)})  # the echo back
            else:
                got = pp.recv_tensor_dict({"h": torch.empty_like(x)})
                pp.send_tensor_dict(got)
            times.append((time.perf_counter() - start) / 2)
        out["send_recv_s"] = statistics.median(times)
    return out


def _run(model: str, batch: int, output_len: int, **parallel) -> dict:
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine.messages import EngineCoreRequest
    from tokenmill.engine_args import EngineArgs
    from tokenmill.sampling_params import SamplingParams

    args = EngineArgs(model=model, dtype="float32", kv_cache_memory="64MiB", max_num_seqs=batch, **parallel)
    core = EngineCore(args.create_engine_config())
    try:
        def generate(tag: str, n_tokens: int) -> list[float]:
            params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
            for i in range(batch):
                core.add_request(EngineCoreRequest(f"{tag}{i}", [3 + i, 7, 11, 13], params))
            times = []
            while core.has_unfinished_requests():
                start = time.perf_counter()
                out = core.step()
                if out.outputs:
                    times.append(time.perf_counter() - start)
            return times

        generate("warm", 8)
        start = time.perf_counter()
        times = generate("run", output_len)
        elapsed = time.perf_counter() - start
        comm = {}
        if core.config.parallel_config.world_size > 1:
            results = core.executor.collective_rpc(_time_collectives, (batch, 50))
            comm = {k: statistics.median(r[k] for r in results if k in r) for k in ("all_reduce_s", "send_recv_s")
                    if any(k in r for r in results)}
        return {"median_step_s": statistics.median(times[1:]), "steps": len(times),
                "output_tokens_per_s": batch * output_len / elapsed, **comm}
    finally:
        core.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="Concurrent requests (default 8).")
    parser.add_argument("--output-len", type=int, default=64, help="Tokens per request (default 64).")
    parser.add_argument("--repeat", type=int, default=3, help="Runs per layout; medians are reported (default 3).")
    parser.add_argument("--no-ray", action="store_true", help="Skip the Ray layouts.")
    parser.add_argument("--json", default=None, help="Write the figures here.")
    args = parser.parse_args(argv)
    model = _build_model(tempfile.mkdtemp(prefix="tm-overhead-"))
    import torch

    from tokenmill.executor.multiproc import threads_per_worker

    # every layout computes with the same threads per rank as a TP=2 / PP=2 worker gets
    torch.set_num_threads(threads_per_worker(2))
    os.environ.setdefault("TOKENMILL_WORKER_THREADS", str(threads_per_worker(2)))
    layouts = [("1 rank (in-process)", {}),
               ("1 rank mp", dict(distributed_executor_backend="mp")),
               ("TP=2 mp", dict(tensor_parallel_size=2)),
               ("PP=2 mp", dict(pipeline_parallel_size=2))]
    if not args.no_ray:
        layouts += [("TP=2 ray", dict(tensor_parallel_size=2, distributed_executor_backend="ray")),
                    ("PP=2 ray", dict(pipeline_parallel_size=2, distributed_executor_backend="ray"))]
    rows = {}
    for name, parallel in layouts:
        runs = [_run(model, args.batch, args.output_len, **parallel) for _ in range(args.repeat)]
        rows[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows[name]["median_step_s_runs"] = [r["median_step_s"] for r in runs]
        print(name, json.dumps(rows[name]), flush=True)
    base = rows["1 rank (in-process)"]["median_step_s"]
    print(f"\n{'layout':<22}{'step ms':>10}{'overhead ms':>13}{'tok/s':>10}{'allreduce us':>14}{'send/recv us':>14}")
    for name, r in rows.items():
        r["overhead_vs_1_rank_s"] = r["median_step_s"] - base
        ar = f"{r['all_reduce_s'] * 1e6:.0f}" if "all_reduce_s" in r else "-"
        sr = f"{r['send_recv_s'] * 1e6:.0f}" if "send_recv_s" in r else "-"
        print(f"{name:<22}{r['median_step_s'] * 1e3:>10.2f}{r['overhead_vs_1_rank_s'] * 1e3:>13.2f}"
              f"{r['output_tokens_per_s']:>10.0f}{ar:>14}{sr:>14}")
    if args.json:
        from tokenmill.entrypoints.bench.common import base_record, write_json

        record = base_record("parallel_overhead", args)
        record.update({"model": "tiny random Llama (hidden 64, 4 layers, float32)", "layouts": rows,
                       "note": "measured on a shared 2-core machine under load from other jobs"})
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
