"""The out-of-tree examples as installed distributions (``make test`` installs them from ``examples/``): the model
plugin greedy-equal to transformers and served by ``tokenmill serve`` through the ``openai`` client, the
platform plugin chosen with ``--platform cpuref`` with its custom op in every model layer and its own KV sizing.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest

from tests.conftest import hf_greedy
from tests.models.test_llama_correctness import run_engine
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 5, 9, 33, 44, 100], [7] * 9, [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("layerscale_llama") is None
                                or importlib.util.find_spec("tokenmill_cpuref") is None,
                                reason="the examples are not installed (make test installs them)")


def test_examples_are_installed_distributions_not_the_source_tree() -> None:
    import layerscale_llama
    import tokenmill_cpuref

    for module in (layerscale_llama, tokenmill_cpuref):
        assert "site-packages" in module.__file__, module.__file__  # built and installed, as a third party would


@pytest.fixture(scope="module")
def layerscale_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """``(layerscale_dir, reference_llama_dir)`` from the example's own recipe, plus a tokenizer for serving."""
    spec = importlib.util.spec_from_file_location("make_test_checkpoint",
                                                  ROOT / "examples/model_plugin/make_test_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    twist, reference = module.build(str(tmp_path_factory.mktemp("layerscale")))
    from tests.engine.engine_fakes import byte_level_tokenizer

    byte_level_tokenizer().save_pretrained(twist)
    return twist, reference


def test_model_plugin_matches_transformers_on_the_equivalent_llama(layerscale_checkpoint: tuple[str, str]) -> None:
    import json

    twist, reference = layerscale_checkpoint
    assert json.loads((Path(twist) / "config.json").read_text())["architectures"] == ["LayerScaleLlamaForCausalLM"]
    core = EngineCore(EngineArgs(model=twist, dtype="float32", block_size=4, num_gpu_blocks_override=64,
                                 max_num_batched_tokens=16).create_engine_config())
    model = core.executor.worker.model_runner.model
    assert type(model).__module__ == "layerscale_llama"
    assert {float(v) for v in model.model.layers[0].attn_scale.unique()} <= {0.5, 2.0, 4.0}  # the gains loaded
    assert run_engine(core, PROMPTS, max_tokens=10) == hf_greedy(reference, PROMPTS, 10)


def test_platform_plugin_runs_the_engine_with_its_custom_op(tiny_llama_dir: str, clean_plugin_state: None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.layers import RMSNorm
    from tokenmill_cpuref.ops import FunctionalRMSNorm
    from tokenmill_cpuref.platform import CpuRefPlatform

    # Host memory in use changes from one moment to the next on a shared machine: fix the plugin's fact.
    monkeypatch.setattr(CpuRefPlatform, "get_device_available_memory", classmethod(lambda cls, device_id=0: 3 << 30))
    config = EngineArgs(model=tiny_llama_dir, dtype="float32", block_size=4, platform="cpuref",
                        kv_cache_memory=None).create_engine_config()
    assert config.device_config.platform == "cpuref"
    core = EngineCore(config)
    norms = [m for m in core.executor.worker.model_runner.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(type(m) is FunctionalRMSNorm for m in norms)
    per_block = core.executor.worker.model_runner.kv_cache_bytes_per_block()
    budget = CpuRefPlatform.determine_kv_cache_bytes(config)
    assert config.cache_config.num_gpu_blocks == budget // per_block  # sized by the plugin's own facts
    assert budget == int((3 << 30) * 0.1)  # a tenth of what is available (under the 1 GiB cap)
    assert run_engine(core, PROMPTS, max_tokens=6) == hf_greedy(tiny_llama_dir, PROMPTS, 6)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_serve_the_model_plugin_through_the_openai_api(layerscale_checkpoint: tuple[str, str], tmp_path: Path) -> None:
    import openai

    from tests.entrypoints.conftest import run_server
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    twist, reference = layerscale_checkpoint
    prompts = ["Hello world, this is a test", "The quick brown fox"]
    llm = LLM(twist, dtype="float32", kv_cache_memory="32MiB", max_model_len=256)
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.shutdown()
    ids = [list(o.prompt_token_ids) for o in offline]
    assert [list(o.outputs[0].token_ids) for o in offline] == hf_greedy(reference, ids, 10)

    args = [twist, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "32MiB",
            "--served-model-name", "layerscale"]
    with contextlib.contextmanager(run_server)(str(tmp_path), args) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt, expected in zip(prompts, offline):
            out = client.completions.create(model="layerscale", prompt=prompt, max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == expected.outputs[0].text
    log_text = Path(server.log_path).read_text(errors="replace")
    assert "model class: LayerScaleLlamaForCausalLM -> layerscale_llama.LayerScaleLlamaForCausalLM" in log_text
    assert "attention backend: CPU_PAGED" in log_text and "platform: cpu (tokenmill-cpu)" in log_text
