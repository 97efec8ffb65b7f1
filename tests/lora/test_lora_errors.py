"""Adapters that cannot be used are refused at load time with the reason, nothing of them stays loaded, and the
engine keeps serving (offline API; the HTTP 400 / 404 mapping is in test_lora_server.py)."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import build_tiny_llama
from tests.lora.adapters import ALL_LLAMA_TARGETS, make_peft_adapter, peft_greedy
from tests.models.families import family_dir
from tokenmill.engine_args import EngineArgs
from tokenmill.entrypoints.llm import LLM
from tokenmill.lora import LoRALoadError, LoRARequest
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [[1, 5, 9, 33, 44, 100]]


@pytest.fixture(scope="module")
def llm(lora_llama_dir) -> LLM:
    return LLM(lora_llama_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=4,
               num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def good_reference(lora_llama_dir, llama_adapters) -> list[list[int]]:
    """transformers + peft tokens for PROMPT with adapter a2, then without an adapter."""
    return peft_greedy(lora_llama_dir, llama_adapters["a2"], PROMPT, 6) + peft_greedy(lora_llama_dir, None, PROMPT, 6)


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _tamper_extra_module(src: str, dst: str) -> str:
    _copy(src, dst)
    weights = load_file(os.path.join(dst, "adapter_model.safetensors"))
    a = next(v for k, v in weights.items() if k.endswith("q_proj.lora_A.weight"))
    b = next(v for k, v in weights.items() if k.endswith("q_proj.lora_B.weight"))
    weights["base_model.model.model.layers.0.self_attn.c_attn.lora_A.weight"] = a.clone()
    weights["base_model.model.model.layers.0.self_attn.c_attn.lora_B.weight"] = b.clone()
    save_file(weights, os.path.join(dst, "adapter_model.safetensors"))
    cfg_path = os.path.join(dst, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["target_modules"] = [*cfg["target_modules"], "c_attn"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return dst


def _truncate_weights(src: str, dst: str) -> str:
    _copy(src, dst)
    path = os.path.join(dst, "adapter_model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return dst


def _bad_json(src: str, dst: str) -> str:
    _copy(src, dst)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        f.write('{"r": 4, "lora_alpha": ')
    return dst


def _bin_only(src: str, dst: str) -> str:
    _copy(src, dst)
    os.rename(os.path.join(dst, "adapter_model.safetensors"), os.path.join(dst, "adapter_model.bin"))
    return dst


@pytest.fixture(scope="module")
def bad_adapters(lora_llama_dir, llama_adapters, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad_adapters")
    deeper = build_tiny_llama(str(root / "deeper_model"), num_hidden_layers=3, seed=9)
    wider = build_tiny_llama(str(root / "wider_model"), hidden_size=96, seed=9)
    return {
        "rank": llama_adapters["a1"],  # rank 8 > max_lora_rank 4
        "module": _tamper_extra_module(llama_adapters["a2"], str(root / "module")),
        "layer": make_peft_adapter(deeper, str(root / "layer"), ["q_proj"], r=4),  # has layers.2, the model has 2
        "shape": make_peft_adapter(wider, str(root / "shape"), ALL_LLAMA_TARGETS, r=4),
        "dora": make_peft_adapter(lora_llama_dir, str(root / "dora"), ["q_proj"], r=4, use_dora=True),
        "corrupt": _truncate_weights(llama_adapters["a2"], str(root / "corrupt")),
        "json": _bad_json(llama_adapters["a2"], str(root / "json")),
        "bin": _bin_only(llama_adapters["a2"], str(root / "bin")),
        "missing": str(root / "does-not-exist"),
    }


REASONS = {
    "rank": "exceeds --max-lora-rank 4",
    "module": "targets ['c_attn']",
    "layer": "'model.layers.2.self_attn.q_proj'",
    "shape": "do not fit the model's layer",
    "dora": "DoRA is not supported",
    "corrupt": "corrupt or unreadable",
    "json": "is not valid JSON",
    "bin": "adapter_model.bin is not read",
    "missing": "is not a directory",
}


@pytest.mark.parametrize("case", list(REASONS))
def test_unusable_adapter_is_refused_with_its_reason(case, llm, bad_adapters, llama_adapters, good_reference):
    lora_id = 100 + list(REASONS).index(case)
    bad = LoRARequest(case, lora_id, bad_adapters[case])
    with pytest.raises(LoRALoadError, match=re.escape(REASONS[case])) as info:
        llm.llm_engine.add_lora(bad)
    assert info.value.param == "lora_path"
    with pytest.raises(LoRALoadError, match=re.escape(REASONS[case])):
        llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=bad)  # the same through a request
    core = llm.llm_engine.engine_core.engine_core
    manager = core.executor.worker.model_runner.lora_manager
    assert lora_id not in llm.llm_engine.list_loras() and lora_id not in manager.list_adapters()
    assert lora_id not in manager.requests
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks and not core.has_unfinished_requests()
    # the engine keeps serving, with and without adapters
    good = LoRARequest("a2", 2, llama_adapters["a2"])
    out = llm.generate(PROMPT * 2, GREEDY, use_tqdm=False, lora_request=[good, None])
    assert [list(o.outputs[0].token_ids) for o in out] == good_reference


def test_moe_expert_adapter_is_refused(family_root, tmp_path):
    model_dir = family_dir("qwen3_moe", family_root)
    adapter = make_peft_adapter(model_dir, str(tmp_path / "experts"), ["q_proj", "gate_proj", "up_proj", "down_proj"],
                                r=4)
    llm = LLM(model_dir, dtype="float32", enable_lora=True, max_lora_rank=64, num_gpu_blocks_override=32)
    with pytest.raises(LoRALoadError, match="target_parameters"):
        llm.llm_engine.add_lora(LoRARequest("experts", 1, adapter))


def test_lora_requests_need_enable_lora(lora_llama_dir, llama_adapters):
    llm = LLM(lora_llama_dir, dtype="float32", num_gpu_blocks_override=32)
    a2 = LoRARequest("a2", 2, llama_adapters["a2"])
    with pytest.raises(LoRALoadError, match="--enable-lora"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=a2)
    with pytest.raises(ValueError, match="lora_request: got 2 for 1 prompts"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=[a2, None])
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_lora_arguments_are_checked(lora_llama_dir):
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(model=lora_llama_dir, enable_lora=True, max_loras=2, max_cpu_loras=1).create_engine_config()
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineArgs(model=lora_llama_dir, enable_lora=True, max_lora_rank=0).create_engine_config()
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")
