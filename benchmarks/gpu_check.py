"""One GPU check for tokenmill: Triton kernels, greedy correctness, offline throughput vs transformers.

Sections (each writes its figures into the JSON at ``--out`` as soon as it ends, so a run cut short still
leaves what it measured):

1. ``kernels``: ``reshape_and_cache`` vs ``index_copy``; ``paged_attention`` vs a float64 reference on random
   inputs at real shapes (Llama-3-8B heads: 32 query / 8 KV heads, D = 128, block 16, a mixed batch of
   prefills, prefix chunks and decodes) in float32 / bfloat16 / float16; time of one layer's attention with
   the Triton and the torch backend (decode batch and prefill batch).
2. ``greedy``: greedy tokens of tokenmill (EngineCore, in process) equal transformers' ``generate`` for a
   random-weight small Llama (float32: must be equal; bfloat16: fraction of equal tokens is reported).
3. ``throughput``: tokenmill offline generation vs transformers ``generate`` in the same run, random-weight
   SmolLM2-135M-shaped and Llama-3-8B-shaped models, prompt 128, 256 new tokens, EOS ignored, batch 1/64/256.

Budget: under 8 minutes end to end on one H200 (``--time-budget-s``, default 420, skips what is left once
spent). ``--quick`` is a smoke run at tiny shapes; on a machine without a GPU it sets ``TRITON_INTERPRET=1``
and runs the kernels on CPU (how it is checked where no GPU is available).

Only tokenmill's offline path is imported (``tokenmill.engine_args``, ``tokenmill.engine.core``), never the
server, so pyzmq, fastapi, uvicorn, pydantic and gguf are not needed. msgspec is (sampling params and engine
messages are msgspec structs) and the H200 image lacks it, so it travels as a wheel.

How to run it on a lent H200 (device tool). Once, here, in the repository root::

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl msgspec==0.19.0

Then one ``run`` call with ``carry=[".whl"]``, ``timeout_s=600`` and this command::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \\
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/cuda || exit; \\
    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log

(``-e .`` installs tokenmill itself, ``-e plugins/cuda`` its CUDA platform entry point; both need no
download: ``--no-deps`` and the image's setuptools.) Results land in ``$OUT/gpu_check.json``; copy them to
``benchmarks/results/``. Locally: ``python benchmarks/gpu_check.py --quick --out /tmp/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform as host_platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

if "--quick" in sys.argv and "--gpu" not in sys.argv:
    # Must precede the first triton import. A --quick run on a GPU machine can pass --gpu to compile instead.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

TRITON_BACKEND = "tokenmill.attention.backends.triton_paged:TritonPagedAttentionBackend"
TORCH_BACKEND = "tokenmill.attention.backends.torch_paged:TorchPagedAttentionBackend"

# Model shapes (random weights): the architecture and sizes of the real checkpoints.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
    ),
    "llama3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5,
    ),
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    ),
}


class Report:
    """Collects every figure and rewrites the JSON file after each section."""

    def __init__(self, path: str, deadline: float) -> None:
        self.path = path
        self.deadline = deadline
        self.start = time.perf_counter()
        self.data: dict[str, Any] = {"env": environment(), "sections": {}, "ok": True}

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()

    def section(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        print(f"\n=== {name} ({self.time_left():.0f} s left)", flush=True)
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # one broken section must not lose the others' figures
            traceback.print_exc()
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.perf_counter() - t0, 2)
        self.data["sections"][name] = result
        if result.get("ok") is False:
            self.data["ok"] = False
        self.write()
        print(json.dumps(result, indent=1, default=str)[:4000], flush=True)

    def write(self) -> None:
        self.data["total_seconds"] = round(time.perf_counter() - self.start, 2)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1, default=str)


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "host": host_platform.node(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
        "cuda_available": torch.cuda.is_available(),
    }
    for mod in ("triton", "transformers", "msgspec"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 - report, do not fail
            env[mod] = f"missing ({type(exc).__name__})"
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    return env


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_ms(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median wall time of ``fn`` in milliseconds (after one warm-up call)."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


# --------------------------------------------------------------------------------------------- 1. kernels


def random_paged_batch(
    q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
    dtype: torch.dtype, device: torch.device, seed: int,
) -> dict[str, Any]:
    """Random requests fully written into a paged cache (blocks in random order, unused slots NaN)."""
    from tokenmill.attention.backend import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    nblk = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblk) + 1
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    table = torch.zeros(len(q_lens), max(nblk), dtype=torch.int32)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    ks, vs, new_k, new_v, slots = [], [], [], [], []
    used = 0
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        ids = perm[used : used + nblk[r]]
        used += nblk[r]
        table[r, : nblk[r]] = ids.int()
        k = torch.randn(sl, num_kv_heads, head_size, generator=g).to(dtype)
        v = torch.randn(sl, num_kv_heads, head_size, generator=g).to(dtype)
        pos = torch.arange(sl)
        slot = ids.long()[pos // block_size] * block_size + pos % block_size
        cache[0].view(-1, num_kv_heads, head_size)[slot[: sl - ql]] = k[: sl - ql]  # cached prefix only
        cache[1].view(-1, num_kv_heads, head_size)[slot[: sl - ql]] = v[: sl - ql]
        ks.append(k)
        vs.append(v)
        new_k.append(k[sl - ql :])
        new_v.append(v[sl - ql :])
        slots.append(slot[sl - ql :])
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], num_heads, head_size, generator=g).to(dtype)
    md = AttentionMetadata(
        num_actual_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.cat(slots).to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
        block_size=block_size,
    )
    return dict(
        q=q.to(device), k_new=torch.cat(new_k).to(device), v_new=torch.cat(new_v).to(device), cache=cache.to(device),
        k_full=ks, v_full=vs, md=md,
    )


def reference_attention(b: dict[str, Any], scale: float) -> torch.Tensor:
    """Float64 softmax attention (CPU) from the full keys/values: ``[T, Hq, D]``, by the conformance kit's
    reference (``tokenmill.conformance.reference.reference_attention``) per request."""
    from tokenmill.conformance.reference import Request, Variant
    from tokenmill.conformance.reference import reference_attention as kit_reference

    md = b["md"]
    q_all = b["q"].double().cpu()
    out = torch.empty(q_all.shape, dtype=torch.float64)
    num_heads, head_size = q_all.shape[1], q_all.shape[2]
    for r, sl in enumerate(md.seq_lens_cpu):
        s, e = md.query_start_loc_cpu[r], md.query_start_loc_cpu[r + 1]
        k, v = b["k_full"][r].double().cpu(), b["v_full"][r].double().cpu()
        q = torch.zeros(sl, num_heads, head_size, dtype=torch.float64)  # only the last e - s positions query
        q[sl - (e - s):] = q_all[s:e]
        variant = Variant("gpu_check", num_heads, k.shape[1], head_size, scale=scale)
        out[s:e] = kit_reference(Request(str(r), q, k, v, []), sl - (e - s), e - s, variant).reshape(e - s, num_heads,
                                                                                                   head_size)
    return out


def check_kernels(device: torch.device, quick: bool) -> dict[str, Any]:
    from tokenmill.attention.backends.torch_paged import TorchPagedAttentionBackend, write_kv_cache
    from tokenmill.attention.backends.triton_paged import TritonPagedAttentionBackend
    from tokenmill.attention.ops.triton_paged_attention import reshape_and_cache

    res: dict[str, Any] = {"ok": True, "cases": []}
    if quick:
        hq, hkv, d, bs = 4, 2, 32, 16
        q_lens, seq_lens = [9, 1, 5, 1], [9, 20, 37, 3]
    else:  # Llama-3-8B attention: 32 query heads, 8 KV heads, D = 128, block 16; mixed batch
        hq, hkv, d, bs = 32, 8, 128, 16
        q_lens = [512, 1, 200, 1, 1, 37] + [1] * 26
        seq_lens = [512, 900, 1200, 17, 2048, 37] + [100 + 37 * i for i in range(26)]
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
    scale = d**-0.5
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        b = random_paged_batch(q_lens, seq_lens, hq, hkv, d, bs, dtype, device, seed=1)
        ref = reference_attention(b, scale)
        t = b["q"].shape[0]
        for backend in (TritonPagedAttentionBackend, TorchPagedAttentionBackend):
            cache = b["cache"].clone()
            if backend is TorchPagedAttentionBackend:
                # Its batched decode reads whole blocks and masks the scores, so unused slots must be finite
                # (0 * NaN = NaN); the engine's cache is zero-initialised. The Triton kernel gets the NaNs.
                cache.nan_to_num_(0.0)
            impl = backend.get_impl_cls()(hq, d, scale, hkv)
            out = impl.forward(b["q"].reshape(t, -1), b["k_new"].reshape(t, -1), b["v_new"].reshape(t, -1), cache, b["md"])
            out = out.view(t, hq, d).double().cpu()
            err = float((out - ref).abs().max() / ref.abs().max())
            case = dict(backend=backend.name, dtype=str(dtype), rel_err=err, tol=tol[dtype], ok=err < tol[dtype])
            res["cases"].append(case)
            res["ok"] = res["ok"] and case["ok"]
        # cache write vs index_copy
        c1 = torch.zeros_like(b["cache"])
        c2 = torch.zeros_like(b["cache"])
        reshape_and_cache(b["k_new"], b["v_new"], c1, b["md"].slot_mapping)
        write_kv_cache(b["k_new"], b["v_new"], c2, b["md"].slot_mapping)
        same = bool(torch.equal(c1, c2))
        res["cases"].append(dict(op="reshape_and_cache", dtype=str(dtype), equal_to_index_copy=same, ok=same))
        res["ok"] = res["ok"] and same
    if device.type == "cuda":
        res["timing_ms"] = time_attention(device, hq, hkv, d, bs)
    return res


def time_attention(device: torch.device, hq: int, hkv: int, d: int, bs: int) -> dict[str, Any]:
    """One layer's attention (cache write + attention), bfloat16, Triton vs torch backend."""
    from tokenmill.attention.backends.torch_paged import TorchPagedAttentionBackend
    from tokenmill.attention.backends.triton_paged import TritonPagedAttentionBackend

    shapes = {
        "decode_b64_ctx1024": ([1] * 64, [1024] * 64),
        "decode_b256_ctx384": ([1] * 256, [384] * 256),
        "prefill_4x512": ([512] * 4, [512] * 4),
        "mixed_prefill512_decode63": ([512] + [1] * 63, [512] + [700] * 63),
    }
    out: dict[str, Any] = {}
    for name, (ql, sl) in shapes.items():
        b = random_paged_batch(ql, sl, hq, hkv, d, bs, torch.bfloat16, device, seed=2)
        b["cache"].nan_to_num_(0.0)
        t = b["q"].shape[0]
        args = (b["q"].reshape(t, -1), b["k_new"].reshape(t, -1), b["v_new"].reshape(t, -1), b["cache"], b["md"])
        row = {}
        for backend in (TritonPagedAttentionBackend, TorchPagedAttentionBackend):
            impl = backend.get_impl_cls()(hq, d, d**-0.5, hkv)
            row[backend.name] = round(bench_ms(lambda: impl.forward(*args), device, reps=20), 4)
        out[name] = row
    return out


# ---------------------------------------------------------------------------------------- model helpers


def build_random_llama(path: str, shape: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int = 0) -> Any:
    """Random-weight LlamaForCausalLM with ``shape``, saved in Hugging Face layout under ``path``; returned
    in eval mode on ``device`` (built there directly: an 8B model initialises in seconds on a GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    # Default init (std 0.02) gives near-uniform logits on deep random models; fine for speed, and the
    # greedy check uses the small model whose logits are well separated.
    model = model.to(dtype).eval()
    model.save_pretrained(path, max_shard_size="4GB")
    return model


def make_engine(model_dir: str, dtype: str, backend: str, device: torch.device, **kwargs: Any) -> Any:
    """An in-process EngineCore; ``backend`` ``"auto"`` keeps the platform's choice."""
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine_args import EngineArgs
    from tokenmill.platforms import get_current_platform

    args = EngineArgs(model=model_dir, dtype=dtype, platform="cuda" if device.type == "cuda" else None, **kwargs)
    config = args.create_engine_config()
    if backend != "auto":
        path = TRITON_BACKEND if backend == "triton" else TORCH_BACKEND
        get_current_platform().get_attn_backend_cls = classmethod(lambda cls, cfg: path)  # type: ignore[method-assign]
    core = EngineCore(config)
    return core


def engine_backend_name(core: Any) -> str:
    worker = getattr(core.executor, "worker", None)
    runner = getattr(worker, "model_runner", None)
    return getattr(getattr(runner, "attn_backend", None), "name", "unknown")


def run_engine(core: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int]:
    """Greedy, EOS ignored; returns each request's tokens and the number of engine steps."""
    from tokenmill.engine.messages import EngineCoreRequest
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"req-{i}", p, params, eos_token_id=None))
    outs: dict[str, list[int]] = {f"req-{i}": [] for i in range(len(prompts))}
    steps = 0
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            outs[o.request_id] += o.new_token_ids
        steps += 1
    return [outs[f"req-{i}"] for i in range(len(prompts))], steps


def hf_generate(model: Any, prompts: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy ``generate`` on equal-length prompts ``[B, L]``; returns the new tokens ``[B, max_new_tokens]``."""
    ids = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return ids[:, prompts.shape[1] :]


def free(*objs: Any) -> None:
    for o in objs:
        shutdown = getattr(o, "shutdown", None)
        if callable(shutdown):
            shutdown()
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- 2. greedy


def check_greedy(device: torch.device, backend: str, tmp: str, quick: bool) -> dict[str, Any]:
    prompts = [[1, 5, 9, 33, 44, 100], [7] * 13, [3, 4], list(range(20, 61)), [11, 300, 301, 302, 17, 18, 19, 400, 2]]
    new = 6 if quick else 24
    res: dict[str, Any] = {"ok": True}
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        if quick and dtype is torch.bfloat16:
            continue
        path = os.path.join(tmp, f"greedy-{dtype_name}")
        model = build_random_llama(path, MODEL_SHAPES["tiny"], dtype, device, seed=0)
        ref = [hf_generate(model, torch.tensor([p], device=device), new)[0].tolist() for p in prompts]
        free(model)
        # Small blocks and a small token budget: chunked prefill over several steps, mixed batches.
        core = make_engine(path, dtype_name, backend, device, block_size=4, max_num_batched_tokens=16,
                           num_gpu_blocks_override=256, max_model_len=512)
        ours, _ = run_engine(core, prompts, new)
        used = engine_backend_name(core)
        free(core)
        equal = sum(a == b for x, y in zip(ours, ref) for a, b in zip(x, y))
        total = sum(len(x) for x in ref)
        entry = dict(backend=used, tokens_equal=equal, tokens_total=total, identical=ours == ref)
        if dtype is torch.float32:
            entry["ok"] = ours == ref
            res["ok"] = res["ok"] and entry["ok"]
        else:  # different kernels round differently in bfloat16; report, do not fail
            entry["note"] = "bfloat16: informational (reduction order differs from transformers' kernels)"
        if ours != ref:
            entry["ours"], entry["transformers"] = ours, ref
        res[dtype_name] = entry
    return res


# ------------------------------------------------------------------------------------------ 3. throughput


def check_throughput(
    device: torch.device, backend: str, tmp: str, models: list[str], batches: list[int], prompt_len: int,
    new_tokens: int, report: Report, quick: bool,
) -> dict[str, Any]:
    res: dict[str, Any] = {"ok": True, "prompt_len": prompt_len, "new_tokens": new_tokens, "runs": []}
    dtype = torch.float32 if quick and device.type == "cpu" else torch.bfloat16
    dtype_name = str(dtype).removeprefix("torch.")
    for name in models:
        if report.time_left() < 30:
            res["runs"].append(dict(model=name, skipped="time budget spent"))
            continue
        path = os.path.join(tmp, f"tp-{name}")
        t0 = time.perf_counter()
        model = build_random_llama(path, MODEL_SHAPES[name], dtype, device, seed=0)
        build_s = time.perf_counter() - t0
        vocab = MODEL_SHAPES[name]["vocab_size"]
        g = torch.Generator().manual_seed(0)
        all_prompts = torch.randint(3, vocab, (max(batches), prompt_len), generator=g)
        rows: dict[int, dict[str, Any]] = {b: dict(model=name, batch=b, dtype=dtype_name) for b in batches}
        hf_generate(model, all_prompts[:1].to(device), 4)  # warm-up
        for b in batches:
            if report.time_left() < 20:
                rows[b]["hf_skipped"] = "time budget spent"
                continue
            p = all_prompts[:b].to(device)
            sync(device)
            t0 = time.perf_counter()
            hf_generate(model, p, new_tokens)
            sync(device)
            s = time.perf_counter() - t0
            rows[b].update(hf_s=round(s, 3), hf_out_tok_per_s=round(b * new_tokens / s, 1))
        del model
        free()
        t0 = time.perf_counter()
        max_batch = max(batches)
        core = make_engine(path, dtype_name, backend, device, max_model_len=prompt_len + new_tokens + 16,
                           max_num_seqs=max(max_batch, 1), enable_prefix_caching=False, seed=0)
        load_s = time.perf_counter() - t0
        used = engine_backend_name(core)
        run_engine(core, [all_prompts[0, :16].tolist()], 4)  # warm-up: kernels compiled, allocator warm
        for b in batches:
            if report.time_left() < 15:
                rows[b]["tokenmill_skipped"] = "time budget spent"
                continue
            prompts = all_prompts[:b].tolist()
            sync(device)
            t0 = time.perf_counter()
            outs, steps = run_engine(core, prompts, new_tokens)
            sync(device)
            s = time.perf_counter() - t0
            produced = sum(len(o) for o in outs)
            rows[b].update(
                tokenmill_s=round(s, 3), tokenmill_out_tok_per_s=round(produced / s, 1), tokenmill_steps=steps,
                tokenmill_backend=used, tokens_produced=produced,
            )
            if "hf_out_tok_per_s" in rows[b]:
                rows[b]["speedup_vs_hf"] = round(rows[b]["tokenmill_out_tok_per_s"] / rows[b]["hf_out_tok_per_s"], 2)
            if produced != b * new_tokens:
                rows[b]["ok"] = False
                res["ok"] = False
        free(core)
        del core
        free()
        for b in batches:
            rows[b].update(build_s=round(build_s, 1), engine_load_s=round(load_s, 1))
            res["runs"].append(rows[b])
        report.data["sections"]["throughput_partial"] = res
        report.write()
        print_table(res["runs"])
    report.data["sections"].pop("throughput_partial", None)
    return res


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':14} {'batch':>5} {'hf tok/s':>10} {'tokenmill tok/s':>16} {'speedup':>8}")
    for r in rows:
        print(f"{r.get('model', ''):14} {r.get('batch', ''):>5} {r.get('hf_out_tok_per_s', '-'):>10} "
              f"{r.get('tokenmill_out_tok_per_s', '-'):>16} {r.get('speedup_vs_hf', '-'):>8}")


# ------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file for every figure")
    ap.add_argument("--quick", action="store_true", help="tiny shapes; on CPU the kernels run interpreted")
    ap.add_argument("--gpu", action="store_true", help="with --quick: compile for the GPU, do not interpret")
    ap.add_argument("--backend", choices=["auto", "triton", "torch"], default="triton",
                    help="attention backend of the engine runs (default triton; auto = the platform's choice)")
    ap.add_argument("--models", default=None, help="comma list of " + ", ".join(MODEL_SHAPES))
    ap.add_argument("--batches", default=None, help="comma list of batch sizes (default 1,64,256)")
    ap.add_argument("--sections", default="kernels,greedy,throughput")
    ap.add_argument("--time-budget-s", type=float, default=420.0)
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() and (not args.quick or args.gpu) else "cpu")
    if device.type == "cpu" and not args.quick:
        print("no GPU visible: use --quick for the CPU smoke run", file=sys.stderr)
        return 2
    report = Report(args.out, time.perf_counter() + args.time_budget_s)
    report.data["args"] = vars(args)
    report.data["device"] = str(device)
    sections = args.sections.split(",")
    if args.quick:
        models = (args.models or "tiny").split(",")
        batches = [int(x) for x in (args.batches or "1,3").split(",")]
        prompt_len, new_tokens = 8, 4
    else:
        models = (args.models or "smollm2-135m,llama3-8b").split(",")
        batches = [int(x) for x in (args.batches or "1,64,256").split(",")]
        prompt_len, new_tokens = 128, 256
    with tempfile.TemporaryDirectory(prefix="tokenmill-gpu-check-") as tmp:
        if "kernels" in sections:
            report.section("kernels", lambda: check_kernels(device, args.quick))
        if "greedy" in sections:
            report.section("greedy", lambda: check_greedy(device, args.backend, tmp, args.quick))
        if "throughput" in sections:
            report.section(
                "throughput",
                lambda: check_throughput(device, args.backend, tmp, models, batches, prompt_len, new_tokens, report,
                                         args.quick),
            )
    report.write()
    print(f"\n{'ALL OK' if report.data['ok'] else 'SOME CHECKS FAILED'}; figures in {args.out} "
          f"({report.data['total_seconds']:.0f} s)")
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
