"""CompiledRunner: torch.compile'd decode steps give transformers' greedy tokens, and stay per model."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import build_tiny_llama, hf_greedy
from tests.models.test_llama_correctness import PROMPTS, run_engine
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.compiled_runner import CompiledRunner
from tokenmill.worker.input_batch import CachedRequestState, build_batch_inputs


@pytest.fixture
def compile_on(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TOKENMILL_COMPILE", "1")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))


def _compiled_core(model_dir: str, **kwargs) -> EngineCore:
    args = dict(model=model_dir, dtype="float32", num_gpu_blocks_override=256, block_size=8)
    args.update(kwargs)
    return EngineCore(EngineArgs(**args).create_engine_config())


def test_compiled_decode_matches_transformers_for_two_models_in_one_process(compile_on, tmp_path) -> None:
    first_dir = build_tiny_llama(str(tmp_path / "a"), seed=1)
    # One layer: the first model's graphs loop over two (a reused graph fails), and a one-layer trace is about
    # half the compile time of a three-layer one.
    second_dir = build_tiny_llama(str(tmp_path / "b"), seed=2, num_hidden_layers=1)
    first = _compiled_core(first_dir)
    second = _compiled_core(second_dir)  # same model class: must not reuse the first model's compiled graph
    for core, model_dir in ((first, first_dir), (second, second_dir)):
        runner = core.executor.worker.model_runner.compiled_runner
        assert runner is not None  # create_if_enabled returns only a runner whose warm-up compiled
        # five requests decode together; short prompts start with a one-block table (padded to two)
        assert run_engine(core, PROMPTS, max_tokens=10) == hf_greedy(model_dir, PROMPTS, 10)
        single = [[5, 6, 7]]
        assert run_engine(core, single, max_tokens=24) == hf_greedy(model_dir, single, 24)  # batch of one
        assert runner.kind_steps["many"] >= 9 and runner.kind_steps["one"] >= 23
        assert runner.kind_steps["mixed"] >= 2  # the prompts' prefills ran compiled too


def test_enforce_eager_and_environment_switch(compile_on, tiny_llama_dir, monkeypatch) -> None:
    assert _compiled_core(tiny_llama_dir, enforce_eager=True).executor.worker.model_runner.compiled_runner is None
    monkeypatch.setenv("TOKENMILL_COMPILE", "0")
    assert _compiled_core(tiny_llama_dir).executor.worker.model_runner.compiled_runner is None


def test_steps_choose_their_compiled_kind() -> None:
    runner = CompiledRunner.__new__(CompiledRunner)
    runner.max_batch_size = 4
    runner.compiled = {"one": None, "many": None, "mixed": None}
    runner.kinds = list(runner.compiled)
    runner.quant_max_rows = 0
    params = SamplingParams(max_tokens=4)

    def state(i: int, tokens: int, computed: int) -> CachedRequestState:
        return CachedRequestState(f"r{i}", list(range(tokens)), 3, params, [i], computed)

    cpu = torch.device("cpu")
    decodes = [state(i, 4, 3) for i in range(5)]
    four = build_batch_inputs(decodes[:4], [1] * 4, 8, cpu)
    assert runner.can_run(four) and runner.kind(four.attn_metadata) == "many"
    one = build_batch_inputs(decodes[:1], [1], 8, cpu)
    assert runner.can_run(one) and runner.kind(one.attn_metadata) == "one"
    assert not runner.can_run(build_batch_inputs(decodes, [1] * 5, 8, cpu))  # above max_batch_size
    prefill = state(9, 3, 0)
    mixed = build_batch_inputs([decodes[0], prefill], [1, 3], 8, cpu)
    assert runner.can_run(mixed) and runner.kind(mixed.attn_metadata) == "mixed"
    # With quantized layers (dense above 2 rows here), decode steps above the limit have their own kind.
    runner.compiled["large"], runner.quant_max_rows = None, 2
    runner.kinds.append("large")
    assert runner.kind(build_batch_inputs(decodes[:2], [1] * 2, 8, cpu).attn_metadata) == "many"
    assert runner.kind(build_batch_inputs(decodes[:3], [1] * 3, 8, cpu).attn_metadata) == "large"


def test_eager_steps_run_on_one_thread_with_a_short_switch_interval_while_a_graph_loads() -> None:
    import sys
    import threading

    runner = CompiledRunner.__new__(CompiledRunner)
    runner._is_loading = threading.Event()
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    with runner.eager_step():
        assert torch.get_num_threads() == threads
    with runner._loading():
        assert sys.getswitchinterval() <= 1e-4
        with runner.eager_step():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == threads
    assert sys.getswitchinterval() == interval and not runner._is_loading.is_set()


def test_quantized_model_compiles_a_large_decode_kind_and_matches_eager(compile_on, tmp_path) -> None:
    # 40 requests decode together: above int8's 32-row limit, where layers use their dense weights. One layer:
    # the quantized layers' branches are per layer, and every kind compiles in about half the time of two layers.
    model_dir = build_tiny_llama(str(tmp_path / "m"), num_hidden_layers=1)
    prompts = [[(7 * i + j) % 50 + 3 for j in range(3 + i % 4)] for i in range(40)]
    eager = run_engine(_compiled_core(model_dir, quantization="int8", enforce_eager=True), prompts, max_tokens=6)
    core = _compiled_core(model_dir, quantization="int8")
    runner = core.executor.worker.model_runner.compiled_runner
    assert runner is not None and runner.quant_max_rows == 32 and "large" in runner.compiled
    assert run_engine(core, prompts, max_tokens=6) == eager
    assert runner.kind_steps["large"] >= 4 and runner.kind_steps["mixed"] >= 1


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the compile worker runs at a lower priority than everything else on the machine
def test_background_mode_serves_eagerly_then_swaps_in_compiled_kinds_and_caches_them(compile_on, tmp_path) -> None:
    model_dir = build_tiny_llama(str(tmp_path / "m"), seed=3, num_hidden_layers=1)  # one layer: a shorter compile
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    expected = hf_greedy(model_dir, prompts, 8)
    core = _compiled_core(model_dir, compile_mode="background")
    runner = core.executor.worker.model_runner.compiled_runner
    assert runner is not None and runner.kinds == ["one", "many", "mixed"]
    # the engine answers before anything is compiled (steps of missing kinds run eagerly)
    assert run_engine(core, prompts, max_tokens=8) == expected
    assert runner.wait(timeout=900), "background compilation did not finish"
    assert sorted(runner.compiled) == ["many", "mixed", "one"]
    assert run_engine(core, prompts, max_tokens=8) == expected
    assert runner.kind_steps["many"] >= 6 and runner.kind_steps["mixed"] >= 1
    assert runner.child is not None and runner.child.returncode == 0
    core.shutdown()
    # a second engine with the same key loads every kind from the cache instead of compiling
    warm = _compiled_core(model_dir)
    warm_runner = warm.executor.worker.model_runner.compiled_runner
    assert sorted(warm_runner.compiled) == ["many", "mixed", "one"] and warm_runner.child is None
    assert run_engine(warm, [[5, 6, 7]], max_tokens=8) == expected[:1]
    assert warm_runner.kind_steps["one"] >= 7 and warm_runner.kind_steps["mixed"] >= 1  # graphs of another process


def test_compile_cache_key_follows_the_architecture_not_the_weights(compile_on, tmp_path) -> None:
    from tokenmill.worker.compile_cache import CompileCache

    base = {"architecture": "a", "dtype": "float32"}
    assert CompileCache(base, []).key == CompileCache(dict(base), []).key
    assert CompileCache(base, []).key != CompileCache({**base, "dtype": "bfloat16"}, []).key
    assert str(CompileCache(base, []).directory).startswith(str(tmp_path / "cache"))


def test_compile_cache_key_is_the_same_for_a_copied_checkpoint(tiny_llama_dir, tmp_path, monkeypatch) -> None:
    """The key holds the architecture, not where the checkpoint lies: a copy (an HF-layout copy served from
    another directory) loads the graphs compiled for the original instead of compiling for minutes."""
    import json
    import shutil

    monkeypatch.setenv("TOKENMILL_COMPILE", "0")  # the key only: nothing compiles

    def key(path: str) -> str:
        runner = _compiled_core(path).executor.worker.model_runner
        return CompiledRunner(runner.model, 4, runner.block_size).cache_for(runner).key

    copy = shutil.copytree(tiny_llama_dir, tmp_path / "copy")
    assert key(str(copy)) == key(tiny_llama_dir)
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6) * 10
    (copy / "config.json").write_text(json.dumps(config))
    assert key(str(copy)) != key(tiny_llama_dir)  # an architecture entry still counts


def test_compile_cache_key_changes_with_a_custom_op_and_with_plugin_sources(tiny_llama_dir, tmp_path,
                                                                            monkeypatch) -> None:
    """A plugin's replacement layer changes the traced graph, so it must change the key (a stale graph would
    silently bypass the plugin's op); a one-file module's source joins the digest too."""
    import sys

    from tokenmill.layers import RMSNorm
    from tokenmill.layers.custom_op import CustomOpRegistry
    from tokenmill.worker.compile_cache import _source_digests, source_digest

    monkeypatch.setenv("TOKENMILL_COMPILE", "0")  # the key only: nothing compiles

    def key() -> str:
        runner = _compiled_core(tiny_llama_dir).executor.worker.model_runner
        return CompiledRunner(runner.model, 4, runner.block_size).cache_for(runner).key

    plain = key()
    assert key() == plain

    class OtherRMSNorm(RMSNorm):
        def forward(self, *args, **kwargs):
            return self.forward_native(*args, **kwargs)

    CustomOpRegistry.register_op("rms_norm", OtherRMSNorm)
    try:
        assert key() != plain
    finally:
        CustomOpRegistry.reset_for_tests()
    assert key() == plain

    module_file = tmp_path / "one_file_plugin_xyz.py"
    module_file.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import one_file_plugin_xyz  # noqa: F401

    try:
        first = source_digest(["one_file_plugin_xyz"])
        _source_digests.pop("one_file_plugin_xyz")
        module_file.write_text("X = 2\n")
        assert source_digest(["one_file_plugin_xyz"]) != first
    finally:
        sys.modules.pop("one_file_plugin_xyz", None)
        _source_digests.pop("one_file_plugin_xyz", None)


def test_compile_cache_key_changes_with_the_linear_methods_facts(tiny_llama_dir, monkeypatch) -> None:
    """A setting that changes what a linear method traces (the CPU plugin's row bound below which the one-request
    graph calls F.linear, which TOKENMILL_CPU_PREPACK=onednn raises) must change the key."""
    from tokenmill_cpu import dense_linear

    monkeypatch.setenv("TOKENMILL_COMPILE", "0")  # the key only: nothing compiles

    def key() -> str:
        runner = _compiled_core(tiny_llama_dir).executor.worker.model_runner
        cache = CompiledRunner(runner.model, 4, runner.block_size).cache_for(runner)
        facts = cache.facts["linear_method_facts"]["tokenmill_cpu.dense_linear.CpuUnquantizedLinearMethod"]
        assert facts["packed_rows_min"]["float32"] == dense_linear.packed_rows(torch.float32)[0]
        return cache.key

    plain = key()
    real = dense_linear.packed_rows
    monkeypatch.setattr(dense_linear, "packed_rows", lambda dtype: (real(dtype)[0] + 3, real(dtype)[1]))
    assert key() != plain
