"""Contract items that run the engine: device graphs replayed against eager steps, and an end-to-end greedy
run of a tiny model against the torch reference backend."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from tokenmill.conformance.target import ConformanceTarget, ContractFailure, ItemSkipped

PROMPTS = [[1, 5, 9, 33, 44, 100, 7, 8, 9, 10], [7] * 9, [3, 4, 5], [1, 5, 9, 33, 44, 100, 7, 8, 60, 61, 62],
           [40, 41]]
MAX_TOKENS = 8
_TINY: dict[str, str] = {}


def tiny_model_dir() -> str:
    """A random-weight Llama checkpoint (2 layers, hidden 64, grouped-query attention, 512 tokens), built once
    per process with transformers' own classes."""
    if "dir" not in _TINY:
        from transformers import LlamaConfig, LlamaForCausalLM

        path = tempfile.mkdtemp(prefix="tokenmill-conformance-")
        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             bos_token_id=1, eos_token_id=2)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            LlamaForCausalLM(config).eval().save_pretrained(path)
        _TINY["dir"] = path
    return _TINY["dir"]


@contextlib.contextmanager
def _eager_compile_off() -> Iterator[None]:
    """torch.compile is not part of the contract checked here (it takes minutes on a small machine)."""
    saved = os.environ.get("TOKENMILL_COMPILE")
    os.environ["TOKENMILL_COMPILE"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENMILL_COMPILE", None)
        else:
            os.environ["TOKENMILL_COMPILE"] = saved


def _engine(t: ConformanceTarget, *, attention_backend: str | None, enforce_eager: bool) -> Any:
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine_args import EngineArgs

    dtype = "float32" if "float32" in t.run_cls.supported_dtypes else "auto"
    args = EngineArgs(model=tiny_model_dir(), dtype=dtype, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                      num_gpu_blocks_override=96, max_model_len=128, enforce_eager=enforce_eager,
                      attention_backend=attention_backend)
    with _eager_compile_off():
        core = EngineCore(args.create_engine_config())
    t.cache.setdefault("engines", []).append(core)
    return core


def drive_staggered(core: Any, prompts: list[list[int]] | None = None, max_tokens: int = MAX_TOKENS
                    ) -> list[list[int]]:
    """Greedy tokens of ``prompts`` (default: the kit's five): three requests, the rest added after three steps
    (mixed steps, then decode batches of 3 and 5).

    Raises:
        ContractFailure: the engine needs more than 200 steps, or KV blocks are not free when it is idle.
    """
    from tokenmill.engine.messages import EngineCoreRequest
    from tokenmill.sampling_params import SamplingParams

    prompts = PROMPTS if prompts is None else prompts
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs: dict[str, list[int]] = {f"k{i}": [] for i in range(len(prompts))}
    for i in range(3):
        core.add_request(EngineCoreRequest(f"k{i}", prompts[i], params))
    steps = 0
    while core.has_unfinished_requests():
        if steps == 3:
            for i in range(3, len(prompts)):
                core.add_request(EngineCoreRequest(f"k{i}", prompts[i], params))
        for o in core.step().outputs:
            outs[o.request_id] += o.new_token_ids
        steps += 1
        if steps > 200:
            raise ContractFailure(f"the engine did not finish {len(prompts)} requests of {max_tokens} tokens in 200 "
                                  "steps")
    pool = core.scheduler.kv_cache_manager.block_pool
    if pool.get_num_free_blocks() != pool.num_blocks:
        raise ContractFailure(f"the engine is idle but {pool.num_blocks - pool.get_num_free_blocks()} KV blocks are "
                              "not free")
    return [outs[f"k{i}"] for i in range(len(prompts))]


def _graphs_claimed(t: ConformanceTarget) -> bool:
    return bool(t.run_cls.supports_graph_capture and t.run_cls.graph_capture_cls())


def _engine_under_test(t: ConformanceTarget) -> Any:
    """The platform's engine (its backend; graphs on when claimed), with every graph replay also run eagerly
    on the same batch and the largest difference recorded."""
    if "engine" in t.cache:
        return t.cache["engine"]
    t.cache["engine"] = None
    core = _engine(t, attention_backend=t.attention_backend, enforce_eager=False)
    t.cache["engine"] = core
    runner = core.executor.worker.model_runner
    graphs = runner.graph_runner
    t.cache["graph_diffs"] = []
    if graphs is not None:
        from tokenmill.forward_context import set_forward_context

        replay = graphs.run

        def checked_run(batch: Any) -> torch.Tensor:
            out = replay(batch).clone()
            with torch.inference_mode(), set_forward_context(batch.attn_metadata):
                eager = runner.model(batch.input_ids, batch.positions)  # writes the same keys/values again
            diff = float((out.double() - eager.double()).abs().max())
            t.cache["graph_diffs"].append((int(batch.input_ids.shape[0]), diff))
            return out

        graphs.run = checked_run
    t.cache["tokens"] = drive_staggered(core)
    return core


def check_graphs(t: ConformanceTarget) -> None:
    """With graphs claimed: the engine captures its decode buckets (through the platform's capture class on a
    real device, the CPU capture emulator otherwise) and every replayed decode step's hidden states equal an
    eager forward pass of the same batch."""
    if not _graphs_claimed(t):
        raise ItemSkipped("the platform does not claim device graphs (supports_graph_capture / graph_capture_cls)")
    backend = t.backend_choice().backend_cls
    if not getattr(backend, "supports_graph_capture", False):
        raise ItemSkipped(f"the attention backend {t.backend_choice().name} does not support graph capture, so "
                          "the engine keeps graphs off with it")
    core = _engine_under_test(t)
    graphs = core.executor.worker.model_runner.graph_runner
    if graphs is None:
        raise ContractFailure("graphs are claimed but the engine built none")
    capture = f"{graphs.capture_cls.__module__}.{graphs.capture_cls.__qualname__}"
    diffs = t.cache["graph_diffs"]
    t.note(f"captured buckets {graphs.batch_sizes} with {capture}; replays per bucket {dict(graphs.replays)}")
    if len(set(graphs.replays)) < 2:
        raise ContractFailure(f"decode steps replayed only from buckets {dict(graphs.replays)}; expected batches of "
                              "3 and 5 requests to use two buckets")
    worst_n, worst = max(diffs, key=lambda d: d[1])
    tol = 1e-5 if core.config.model_config.dtype == "float32" else 1e-2
    t.note(f"{len(diffs)} replays compared with eager: largest difference {worst:.2e}")
    if not worst <= tol:
        raise ContractFailure(f"a decode step of {worst_n} requests replayed from its graph differs from the eager "
                              f"step by {worst:.3g} (> {tol:g}): work that happens only while capturing (host "
                              "values read at capture time, state cached on Python objects) is frozen in the graph")


def check_e2e(t: ConformanceTarget) -> None:
    """Greedy tokens of 5 prompts (chunked prefill with a 16-token budget, a shared prefix, decode batches of
    3 and 5) on the platform's backend (and graphs) equal those of the torch reference backend run eagerly on
    the same platform; every KV block is free when the engine is idle."""
    ours = _engine_under_test(t)
    reference = _engine(t, attention_backend="TORCH_PAGED", enforce_eager=True)
    want = drive_staggered(reference)
    got = t.cache["tokens"]
    dtype = ours.config.model_config.dtype
    t.note(f"{len(PROMPTS)} prompts x {MAX_TOKENS} tokens in {dtype}; reference TORCH_PAGED, eager")
    if got != want:
        i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        j = next(j for j, (a, b) in enumerate(zip(got[i], want[i])) if a != b)
        raise ContractFailure(f"greedy tokens differ from the torch reference backend: prompt {i}, token {j}: "
                              f"{got[i][j]} vs {want[i][j]} (got {got[i]}, want {want[i]})")
    graphs = ours.executor.worker.model_runner.graph_runner
    if graphs is not None:
        t.note(f"graph replays during the run: {sum(graphs.replays.values())}")


__all__ = ["check_e2e", "check_graphs", "tiny_model_dir"]
