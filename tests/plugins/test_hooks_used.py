"""Every documented hook is one the engine uses: attention backends resolved by name through the registry (a
plugin overrides one), custom ops replacing layers in model code, quantized-linear and fused-MoE kernels from
the op registry, ``tokenmill_init_process`` in every process, and the start-up logs naming what was chosen."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tests.conftest import hf_greedy
from tests.models.test_llama_correctness import run_engine
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs

if TYPE_CHECKING:
    from conftest import FakeSite

PROMPTS = [[1, 5, 9, 33, 44, 100], [7] * 9, [3, 4, 5]]

OVERRIDES = """
import os

from tokenmill.plugin_api import RMSNorm, TorchPagedAttentionBackend, TorchPagedAttentionImpl, hookimpl

CALLS = {"attention": 0, "rms_norm": 0}


class SpyImpl(TorchPagedAttentionImpl):
    def forward(self, *args, **kwargs):
        CALLS["attention"] += 1
        return super().forward(*args, **kwargs)


class SpyBackend(TorchPagedAttentionBackend):
    name = "SPY_PAGED"

    @staticmethod
    def get_impl_cls():
        return SpyImpl


class CountingRMSNorm(RMSNorm):
    def forward(self, x, residual=None):
        CALLS["rms_norm"] += 1
        return self.forward_native(x, residual)


@hookimpl
def tokenmill_register_attention_backends(registry):
    registry.register_backend("CPU_PAGED", __name__ + ":SpyBackend")  # overrides tokenmill-cpu's entry
    registry.register_backend("SPY_PAGED", __name__ + ":SpyBackend")


@hookimpl
def tokenmill_register_custom_ops(registry):
    registry.register_op("rms_norm", __name__ + ":CountingRMSNorm")


@hookimpl
def tokenmill_init_process(process):
    path = os.environ.get("TOKENMILL_TEST_PROCESS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {process}\\n")
"""


@pytest.fixture
def overrides(fake_site: FakeSite) -> object:
    import sys

    module = fake_site.unique_module("overrides")
    fake_site.add_module(module, OVERRIDES)
    fake_site.add_distribution("fake-overrides", {"tokenmill.plugins": {"overrides": module}})
    fake_site.use_all_distributions()  # the real cpu platform and built-in models too
    __import__(module)
    return sys.modules[module]


def test_plugin_overrides_the_platforms_backend_and_a_layer(overrides, tiny_llama_dir: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    from tokenmill.layers import RMSNorm
    from tokenmill.entrypoints.plugins_diagnosis import collect_diagnosis

    args = EngineArgs(model=tiny_llama_dir, dtype="float32", block_size=4, num_gpu_blocks_override=64)
    with caplog.at_level(logging.INFO):
        core = EngineCore(args.create_engine_config())
    runner = core.executor.worker.model_runner
    assert runner.attn_backend is overrides.SpyBackend  # platform cpu said CPU_PAGED; the registry gave the plugin's
    norms = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(type(m) is overrides.CountingRMSNorm for m in norms)  # model code unchanged
    assert run_engine(core, PROMPTS, max_tokens=6) == hf_greedy(tiny_llama_dir, PROMPTS, 6)
    assert overrides.CALLS["attention"] > 0 and overrides.CALLS["rms_norm"] > 0
    logs = caplog.text
    assert "platform: cpu (tokenmill-cpu): the only active platform plugin" in logs
    assert "attention backend: CPU_PAGED (" in logs and "SpyBackend, registered by plugin tokenmill.plugins:overrides" in logs
    assert "model class: LlamaForCausalLM -> tokenmill.models.llama.LlamaForCausalLM" in logs
    report = collect_diagnosis()
    assert report["attention_backends"]["CPU_PAGED"]["source"] == "plugin tokenmill.plugins:overrides"
    assert report["custom_ops"]["rms_norm"] == {"class": f"{overrides.__name__}:CountingRMSNorm",
                                                "source": "plugin tokenmill.plugins:overrides"}
    hooks = {ep["name"]: ep["hooks"] for d in report["distributions"].values() for ep in d["entry_points"]}
    assert hooks["overrides"] == ["tokenmill_init_process", "tokenmill_register_attention_backends",
                                  "tokenmill_register_custom_ops"]


def test_attention_backend_flag_picks_a_registered_backend(overrides, tiny_llama_dir: str) -> None:
    args = EngineArgs(model=tiny_llama_dir, dtype="float32", block_size=4, num_gpu_blocks_override=64,
                      attention_backend="torch_paged")
    core = EngineCore(args.create_engine_config())
    from tokenmill.attention.backends.torch_paged import TorchPagedAttentionBackend

    assert core.executor.worker.model_runner.attn_backend is TorchPagedAttentionBackend
    with pytest.raises(ValueError, match="attention_backend: unknown attention backend 'NOPE'.*SPY_PAGED"):
        args.replace(attention_backend="NOPE").create_engine_config()


def test_custom_op_registry_feeds_fused_moe_and_quantized_linear(clean_plugin_state: None) -> None:
    from tokenmill.layers.custom_op import CustomOpRegistry, UnknownCustomOpError, resolve_custom_op
    from tokenmill.layers.fused_moe import get_fused_moe_method_path
    from tokenmill.layers.layernorm import RMSNorm
    from tokenmill.layers.quantization import Int8WeightOnly, get_quantized_weight_cls

    class MyInt8(Int8WeightOnly):
        pass

    assert get_fused_moe_method_path() == "tokenmill.layers.fused_moe:TorchFusedMoEMethod"
    CustomOpRegistry.register_op("fused_moe", "my_pkg.moe:Fast")
    assert get_fused_moe_method_path() == "my_pkg.moe:Fast"
    CustomOpRegistry.register_op("quant_linear.int8", MyInt8)
    assert get_quantized_weight_cls("int8") is MyInt8
    CustomOpRegistry.register_op("rms_norm", "collections:OrderedDict")
    with pytest.raises(TypeError, match="custom op 'rms_norm' from script: collections.OrderedDict must subclass"):
        resolve_custom_op("rms_norm", RMSNorm)
    with pytest.raises(UnknownCustomOpError, match="rms_norm, rotary_embedding"):
        CustomOpRegistry.register_op("layer_norm", MyInt8)


@pytest.mark.timeout(300)
def test_init_process_hook_runs_in_the_engine_and_every_worker_process(overrides, tiny_llama_dir: str,
                                                                      tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "processes.log"
    monkeypatch.setenv("TOKENMILL_TEST_PROCESS_LOG", str(log))
    args = EngineArgs(model=tiny_llama_dir, dtype="float32", block_size=4, num_gpu_blocks_override=32,
                      tensor_parallel_size=2, distributed_executor_backend="mp")
    core = EngineCore(args.create_engine_config())
    try:
        assert run_engine(core, PROMPTS[:1], max_tokens=3) == hf_greedy(tiny_llama_dir, PROMPTS[:1], 3)
    finally:
        core.shutdown()
    lines = [line.split() for line in log.read_text().splitlines()]
    kinds = {pid: kind for pid, kind in lines}
    assert len(kinds) == len(lines), "the hook ran twice in one process"
    assert kinds[str(os.getpid())] == "engine_core"
    workers = [pid for pid, kind in kinds.items() if kind == "worker"]
    assert len(workers) == 2 and str(os.getpid()) not in workers  # both spawned ranks


def test_rotary_and_activation_overrides_reach_every_layer(clean_plugin_state: None) -> None:
    """get_rope hands out the replacement too (its cache is keyed by the class in use)."""
    from tokenmill.layers import RotaryEmbedding, SiluAndMul, get_act_and_mul, get_rope
    from tokenmill.layers.custom_op import CustomOpRegistry

    class MyRope(RotaryEmbedding):
        pass

    class MySilu(SiluAndMul):
        pass

    before = get_rope(16, 64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    CustomOpRegistry.register_op("rotary_embedding", MyRope)
    CustomOpRegistry.register_op("silu_and_mul", MySilu)
    after = get_rope(16, 64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert type(before) is RotaryEmbedding and type(after) is MyRope
    assert type(get_act_and_mul("silu")) is MySilu
    x = torch.randn(3, 8)
    assert torch.equal(get_act_and_mul("silu")(x), SiluAndMul.forward_native(MySilu(), x))


PROCESSORS = """
import torch

from tokenmill.plugin_api import LogitsProcessor, hookimpl

CALLS = {"ban": 0, "noop": 0}


class BanTokens(LogitsProcessor):
    def apply(self, logits, batch):
        CALLS["ban"] += 1
        for row, params in enumerate(batch.sampling_params):
            banned = (params.extra_args or {}).get("ban")
            if banned:
                logits[row, torch.tensor(banned)] = float("-inf")
        return logits


class ArgmaxInvariant(LogitsProcessor):
    def is_argmax_invariant(self):
        return True

    def apply(self, logits, batch):
        CALLS["noop"] += 1
        return logits


@hookimpl
def tokenmill_register_logits_processors(registry):
    registry.register_logits_processor("ban_tokens", __name__ + ":BanTokens")
"""


def test_logits_processor_plugin_acts_on_the_requests_that_ask(fake_site: FakeSite, tiny_llama_dir: str) -> None:
    import sys

    from tokenmill.engine.messages import EngineCoreRequest
    from tokenmill.entrypoints.plugins_diagnosis import collect_diagnosis
    from tokenmill.sampling_params import SamplingParams

    module = fake_site.unique_module("processors")
    fake_site.add_module(module, PROCESSORS)
    fake_site.add_distribution("fake-processors", {"tokenmill.plugins": {"processors": module}})
    fake_site.use_all_distributions()
    want = hf_greedy(tiny_llama_dir, PROMPTS[:2], 5)
    args = EngineArgs(model=tiny_llama_dir, dtype="float32", block_size=4, num_gpu_blocks_override=64,
                      logits_processors=[f"{module}:ArgmaxInvariant"])
    core = EngineCore(args.create_engine_config())
    plain = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    banned = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, extra_args={"ban": [want[1][0]]})
    core.add_request(EngineCoreRequest("plain", PROMPTS[0], plain))
    core.add_request(EngineCoreRequest("banned", PROMPTS[1], banned))
    outs: dict[str, list[int]] = {"plain": [], "banned": []}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            outs[o.request_id] += o.new_token_ids
    calls = sys.modules[module].CALLS
    assert outs["plain"] == want[0]  # a request that asks for nothing is untouched
    assert outs["banned"][0] != want[1][0] and want[1][0] not in outs["banned"]
    assert calls["ban"] > 0 and calls["noop"] == 0  # all-greedy steps skip argmax-invariant work (vLLM's rule)
    report = collect_diagnosis()
    assert report["logits_processors"]["ban_tokens"]["source"] == "plugin tokenmill.plugins:processors"
