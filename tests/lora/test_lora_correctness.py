"""Greedy tokens with LoRA adapters equal transformers + peft for the same adapters, with adapters and the base
model mixed in one batch; slots swapped LRU when there are more adapters than slots; adapters never share
prefix-cache blocks; no KV block leaks."""

from __future__ import annotations

import pytest

from tests.engine.tiny_model import ScheduleRecorder
from tests.lora.adapters import make_peft_adapter, peft_greedy
from tests.models.families import family_dir
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.engine_args import EngineArgs
from tokenmill.entrypoints.llm import LLM
from tokenmill.lora import LoRARequest
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[1, 5, 9, 33, 44, 100], [7] * 13, [3, 4, 250, 251, 252], list(range(20, 45))]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _engine_core(llm: LLM) -> EngineCore:
    return llm.llm_engine.engine_core.engine_core


def _assert_no_leaks(llm: LLM) -> None:
    pool = _engine_core(llm).scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks, "KV blocks leaked"


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_mixed_batch_of_two_adapters_and_base_matches_peft(lora_llama_dir, llama_adapters):
    llm = LLM(lora_llama_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              num_gpu_blocks_override=256)
    recorder = ScheduleRecorder(_engine_core(llm).scheduler)
    a1 = LoRARequest("a1", 1, llama_adapters["a1"])
    a2 = LoRARequest("a2", 2, llama_adapters["a2"])
    kinds = [a1, a2, None]
    prompts = [p for p in PROMPTS for _ in kinds]
    loras = [k for _ in PROMPTS for k in kinds]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    expected = {None: peft_greedy(lora_llama_dir, None, PROMPTS, MAX_TOKENS)}
    for lora in (a1, a2):
        expected[lora.lora_int_id] = peft_greedy(lora_llama_dir, lora.lora_path, PROMPTS, MAX_TOKENS)
    got = _tokens(outs)
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        assert got[i] == expected[None if lora is None else lora.lora_int_id][PROMPTS.index(p)], (i, lora)
    assert expected[1] != expected[None] and expected[2] != expected[None] and expected[1] != expected[2]
    # one forward pass held all three kinds: requests of both adapters and of the base model
    first = recorder.steps[0].scheduled_new_reqs
    assert {r.lora_request.lora_int_id if r.lora_request else 0 for r in first} == {0, 1, 2}
    _assert_no_leaks(llm)
    # a single LoRARequest applies to every prompt
    again = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=a2)
    assert _tokens(again) == expected[2][:2]
    _assert_no_leaks(llm)


def test_lru_slots_with_one_slot_and_three_adapters(lora_llama_dir, llama_adapters):
    """``max_loras=1``: each step uses one adapter (base requests ride along); ``max_cpu_loras=2``: the third
    adapter pushes the first out of host memory, so it is read again from disk later."""
    llm = LLM(lora_llama_dir, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8,
              num_gpu_blocks_override=256)
    core = _engine_core(llm)
    recorder = ScheduleRecorder(core.scheduler)
    loras = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(llama_adapters.items()))]
    prompts, reqs = [], []
    for p in PROMPTS[:2]:
        for lora in [*loras, None]:
            prompts.append(p)
            reqs.append(lora)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs)
    expected = {None: peft_greedy(lora_llama_dir, None, PROMPTS[:2], MAX_TOKENS)}
    for lora in loras:
        expected[lora.lora_int_id] = peft_greedy(lora_llama_dir, lora.lora_path, PROMPTS[:2], MAX_TOKENS)
    got = _tokens(outs)
    for i, (p, lora) in enumerate(zip(prompts, reqs)):
        assert got[i] == expected[None if lora is None else lora.lora_int_id][PROMPTS.index(p)], (i, lora)
    for so in recorder.steps:
        ids = {core.scheduler.requests[r].lora_int_id for r in so.num_scheduled_tokens
               if r in core.scheduler.requests and core.scheduler.requests[r].lora_request is not None}
        assert len(ids) <= 1
    lora_manager = _lora_manager(core)
    assert len(lora_manager.cpu_cache) <= 2 and len(lora_manager.slot_lru) == 1
    assert 1 not in lora_manager.cpu_cache  # the least recently used adapter left host memory
    again = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=loras[0])
    assert _tokens(again) == expected[1]
    _assert_no_leaks(llm)


def _lora_manager(core: EngineCore):
    return core.executor.worker.model_runner.lora_manager  # UniProcExecutor: the worker is in this process


def test_adapters_never_share_prefix_cache_blocks(lora_llama_dir, llama_adapters):
    core = EngineCore(EngineArgs(model=lora_llama_dir, dtype="float32", enable_lora=True, max_loras=2,
                                 max_lora_rank=8, block_size=8, num_gpu_blocks_override=128).create_engine_config())
    prompt = PROMPTS[3]  # 25 tokens: 3 full blocks of 8
    a1 = LoRARequest("a1", 1, llama_adapters["a1"])
    a2 = LoRARequest("a2", 2, llama_adapters["a2"])

    def run(rid: str, lora: LoRARequest | None) -> tuple[list[int], int]:
        core.add_request(EngineCoreRequest(rid, prompt, GREEDY, lora_request=lora))
        tokens, cached = [], 0
        while core.has_unfinished_requests():
            for o in core.step().outputs:
                tokens += o.new_token_ids
                cached = max(cached, o.num_cached_tokens)
        pool = core.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks
        return tokens, cached

    t1, c1 = run("x1", a1)
    t2, c2 = run("x2", a2)
    t0, c0 = run("x0", None)
    t1b, c1b = run("x1b", a1)
    assert (c1, c2, c0) == (0, 0, 0)  # the same prompt under another adapter (or none) hits nothing
    assert c1b == 24  # under the same adapter it hits its 3 full blocks
    assert t1b == t1
    ref = {name: peft_greedy(lora_llama_dir, path, [prompt], MAX_TOKENS)[0]
           for name, path in (("a1", a1.lora_path), ("a2", a2.lora_path), ("base", None))}
    assert (t1, t2, t0) == (ref["a1"], ref["a2"], ref["base"])


@pytest.mark.parametrize("name,targets", [
    ("qwen3", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),  # packed qkv, q/k norm
    ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),  # adapters of the fused layers themselves
    # a regex (PEFT's other form of target_modules) naming attention only: on an MoE model PEFT turns gate/up/down
    # into target_parameters of the fused experts, which tokenmill refuses (tests/lora/test_lora_errors.py)
    ("qwen3_moe", r".*\.self_attn\.[qkvo]_proj"),
])
def test_other_families_match_peft(name, targets, family_root, tmp_path):
    model_dir = family_dir(name, family_root)
    adapter = make_peft_adapter(model_dir, str(tmp_path / "adapter"), targets, r=4, seed=7)
    llm = LLM(model_dir, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=4,
              num_gpu_blocks_override=128)
    lora = LoRARequest("fam", 1, adapter)
    prompts = PROMPTS[:3]
    outs = llm.generate(prompts * 2, GREEDY, use_tqdm=False, lora_request=[lora] * 3 + [None] * 3)
    with_lora = peft_greedy(model_dir, adapter, prompts, MAX_TOKENS)
    base = peft_greedy(model_dir, None, prompts, MAX_TOKENS)
    assert _tokens(outs) == with_lora + base
    assert with_lora != base
    _assert_no_leaks(llm)


def _layer0_lora_shapes(worker) -> dict:
    return {n: (tuple(m.lora_a.shape), tuple(m.lora_b.shape))
            for n, m in worker.model_runner.lora_manager.layers.items() if n.startswith("model.layers.0.")}


def run_mixed(core: EngineCore, prompts: list[list[int]], kinds: list[LoRARequest | None],
              params: SamplingParams) -> dict[str, list[int]]:
    """Every (prompt ``i``, adapter ``j``) pair as request ``r{i}-{j}``, run to completion; the tokens per
    request. Asserts that every KV block is free afterwards."""
    for i, p in enumerate(prompts):
        for j, lora in enumerate(kinds):
            core.add_request(EngineCoreRequest(f"r{i}-{j}", p, params, lora_request=lora))
    outs: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks, "KV blocks leaked"
    return outs


def test_tensor_parallel_2_shards_adapters_like_the_base_layers(lora_llama_dir, llama_adapters):
    """TP 2 (multiproc, gloo): q/k/v heads and gate/up halves of lora_B follow the base rows on each rank,
    lora_A of o_proj / down_proj is split by input columns; the tokens equal transformers + peft."""
    from tokenmill.executor.multiproc import MultiprocExecutor

    core = EngineCore(EngineArgs(model=lora_llama_dir, dtype="float32", tensor_parallel_size=2, enable_lora=True,
                                 max_loras=2, max_lora_rank=8, block_size=4,
                                 kv_cache_memory="512KiB").create_engine_config())
    try:
        assert isinstance(core.executor, MultiprocExecutor)
        kinds = [LoRARequest("a1", 1, llama_adapters["a1"]), LoRARequest("a3", 3, llama_adapters["a3"]), None]
        prompts = PROMPTS[:2]
        outs = run_mixed(core, prompts, kinds, GREEDY)
        for j, lora in enumerate(kinds):
            ref = peft_greedy(lora_llama_dir, lora.lora_path if lora else None, prompts, MAX_TOKENS)
            assert [outs[f"r{i}-{j}"] for i in range(len(prompts))] == ref, lora
        shapes = core.executor.collective_rpc(_layer0_lora_shapes)
        assert shapes[0] == shapes[1]
        # 2 slots; qkv: 3 x rank 8 packed, 64 inputs, (2 + 1 + 1) heads of 16 rows per rank; o_proj: 32 inputs
        assert shapes[0]["model.layers.0.self_attn.qkv_proj"] == ((2, 24, 64), (2, 64, 24))
        assert shapes[0]["model.layers.0.self_attn.o_proj"] == ((2, 8, 32), (2, 64, 8))
        assert shapes[0]["model.layers.0.mlp.down_proj"] == ((2, 8, 64), (2, 64, 8))
    finally:
        core.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_model_with_adapters_matches_peft(hf_default_model, tmp_path):
    """The embedded SmolLM2-135M (GGUF, dequantized by both sides) with two adapters and the base model in one
    batch. Both adapters are made and run on one copy of the session's transformers model."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    prompts = [[1, 504, 3458, 282, 260, 3575, 314, 4649, 47], [1, 19556, 253, 31901, 10060, 30]]
    n = 8
    hf = copy.deepcopy(hf_default_model)

    hf.generation_config.eos_token_id = None  # like ignore_eos: EOS is a token like any other (not masked)
    hf.generation_config.pad_token_id = 0

    def greedy(model) -> list[list[int]]:
        out = []
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
            out.append(ids[0, len(p):].tolist())
        return out

    refs: dict[int, list[list[int]]] = {0: greedy(hf)}
    specs = {1: (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 8, 0.05),
             2: (["q_proj", "v_proj"], 16, 0.1)}
    kinds: list[LoRARequest | None] = []
    for lid, (targets, r, std) in specs.items():
        peft_model = get_peft_model(hf, LoraConfig(r=r, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
        gen = torch.Generator().manual_seed(lid)
        with torch.no_grad():
            for pname, param in peft_model.named_parameters():
                if "lora_" in pname:
                    param.copy_(torch.randn(param.shape, generator=gen) * std)
        path = str(tmp_path / f"a{lid}")
        peft_model.save_pretrained(path)
        refs[lid] = greedy(peft_model.eval())
        hf = peft_model.unload()
        kinds.append(LoRARequest(f"a{lid}", lid, path))
    kinds.append(None)
    del hf
    core = EngineCore(EngineArgs(max_model_len=512, kv_cache_memory="64MiB", enable_lora=True, max_loras=2,
                                 max_lora_rank=16).create_engine_config())
    outs = run_mixed(core, prompts, kinds, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    for j, lora in enumerate(kinds):
        lid = 0 if lora is None else lora.lora_int_id
        assert [outs[f"r{i}-{j}"] for i in range(len(prompts))] == refs[lid], lora
    assert refs[1] != refs[0] and refs[2] != refs[0]


def test_unloading_an_adapter_in_use_lets_its_requests_finish(lora_llama_dir, llama_adapters, tmp_path):
    import shutil

    path = shutil.copytree(llama_adapters["a2"], str(tmp_path / "a2"))
    core = EngineCore(EngineArgs(model=lora_llama_dir, dtype="float32", enable_lora=True, max_loras=1,
                                 max_lora_rank=8, num_gpu_blocks_override=64).create_engine_config())
    a2 = LoRARequest("a2", 2, path)
    assert core.add_lora(a2.lora_name, a2.lora_int_id, a2.lora_path) is None
    core.add_request(EngineCoreRequest("x", PROMPTS[0], GREEDY, lora_request=a2))
    tokens = [t for o in core.step().outputs for t in o.new_token_ids]
    assert core.remove_lora(2) and core.list_loras() == []
    shutil.rmtree(path)  # the directory is gone: the running request must not need it
    while core.has_unfinished_requests():
        tokens += [t for o in core.step().outputs for t in o.new_token_ids]
    assert tokens == peft_greedy(lora_llama_dir, llama_adapters["a2"], [PROMPTS[0]], MAX_TOKENS)[0]
    core.step()
    assert core.executor.worker.model_runner.lora_manager.list_adapters() == []
