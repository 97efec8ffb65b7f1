"""``tokenmill plugins`` (text and ``--json``) and clean CLI errors for platform and plugin problems."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from tokenmill.entrypoints.cli import main

if TYPE_CHECKING:
    from conftest import FakeSite


def _plugins_json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    assert main(["plugins", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_plugins_lists_installed_distributions_platforms_and_registries(
    clean_plugin_state: None, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _plugins_json(capsys)
    dists = d["distributions"]
    for name in ("tokenmill", "tokenmill-cpu", "tokenmill-cuda", "tokenmill-rocm", "tokenmill-cpuref",
                 "tokenmill-layerscale-llama"):
        assert name in dists, name
    cpu = dists["tokenmill-cpu"]["entry_points"][0]
    from tokenmill_cpu.plugin import TOKENMILL_PLUGIN_API

    assert cpu["loaded"] and cpu["requires_plugin_api"] == TOKENMILL_PLUGIN_API
    assert cpu["hooks"] == ["tokenmill_platform", "tokenmill_register_attention_backends"]
    assert dists["tokenmill-layerscale-llama"]["entry_points"][0]["hooks"] == ["tokenmill_register_models"]
    tried = {p["name"]: p for p in d["platforms"]}
    assert tried["cpu"]["active"] and not tried["cuda"]["active"] and "without CUDA" in tried["cuda"]["reason"]
    assert not tried["cpuref"]["active"] and "TOKENMILL_CPUREF" in tried["cpuref"]["reason"]
    assert d["selection"]["selected"] == "cpu" and "only active platform" in d["selection"]["reason"]
    assert d["attention_backend"] == {"name": "CPU_PAGED", "class": "tokenmill_cpu.attention:CpuPagedAttentionBackend",
                                      "chosen_by": "platform cpu", "registered_by": "plugin tokenmill.platforms:cpu"}
    assert d["architectures"]["LayerScaleLlamaForCausalLM"] == {
        "target": "layerscale_llama:LayerScaleLlamaForCausalLM", "source": "plugin tokenmill.plugins:layerscale_llama"}
    assert d["architectures"]["LlamaForCausalLM"]["source"] == "plugin tokenmill.plugins:builtin_models"
    assert set(d["attention_backends"]) >= {"CPU_PAGED", "TORCH_PAGED", "TRITON_PAGED"}
    assert set(d["custom_ops"]) >= {"rms_norm", "rotary_embedding", "fused_moe", "quant_linear.int4",
                                    "unquantized_linear"}
    assert d["custom_ops"]["unquantized_linear"] == {"class": "tokenmill_cpu.dense_linear:CpuUnquantizedLinearMethod",
                                                     "source": "platform cpu"}
    assert set(d["quantization_methods"]) == {"int8", "int4"}
    assert "tool_parsers" in d
    assert d["warnings"] == []
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    for section in ("Plugin distributions:", "Platforms tried:", "Selected platform: cpu", "Attention backend: CPU_PAGED",
                    "Architectures:", "Attention backends:", "Custom ops:", "Quantization methods:", "Tool parsers:",
                    "Warnings: none"):
        assert section in text, section


def test_plugins_with_model_names_its_class(clean_plugin_state: None, tiny_llama_dir: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    d = _plugins_json(capsys, "--model", tiny_llama_dir)
    assert d["model"]["class"] == "tokenmill.models.llama:LlamaForCausalLM"


BROKEN = "import definitely_not_a_module_xyz\n"


def test_plugins_reports_broken_plugins_raising_detectors_and_conflicts(
    fake_site: FakeSite, capsys: pytest.CaptureFixture[str]
) -> None:
    module = fake_site.unique_module("broken")
    fake_site.add_module(module, BROKEN)
    fake_site.add_distribution("fake-broken", {"tokenmill.plugins": {"broken": module}})
    fake_site.add_platform_plugin("fake-alpha", "alpha", "return True, 'alpha here'")
    fake_site.add_platform_plugin("fake-beta", "beta", "return True, 'beta here'")
    fake_site.add_platform_plugin("fake-gamma", "gamma", "raise RuntimeError('driver exploded')")
    d = _plugins_json(capsys)
    ep = d["distributions"]["fake-broken"]["entry_points"][0]
    assert not ep["loaded"] and "definitely_not_a_module_xyz" in ep["error"]
    assert "ModuleNotFoundError" in ep["traceback_tail"]
    assert d["distributions"]["fake-alpha"]["entry_points"][0]["loaded"]  # the others still load
    tried = {p["name"]: p for p in d["platforms"]}
    assert "RuntimeError: driver exploded" in tried["gamma"]["detector_error"]
    assert d["selection"]["selected"] is None and d["selection"]["error"]["type"] == "PlatformDetectionError"
    warnings = "\n".join(d["warnings"])
    assert "failed to load" in warnings and "more than one platform plugin is active (alpha, beta)" in warnings
    assert "detector of platform gamma" in warnings
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "FAILED" in text and "| ModuleNotFoundError" in text and "detect() RAISED RuntimeError" in text


def _cli(args: list[str], env_extra: dict[str, str], pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)


@pytest.mark.parametrize("case", ["no_platform", "conflict", "detector_raises", "unknown_architecture"])
def test_serve_platform_errors_are_one_clean_line(case: str, tiny_llama_dir: str, fake_site: FakeSite,
                                                  tmp_path) -> None:  # noqa: ANN001
    env: dict[str, str] = {}
    path = None
    model = tiny_llama_dir
    if case == "unknown_architecture":  # reported by the engine-core process, said by the front end
        import shutil

        from tests.engine.engine_fakes import byte_level_tokenizer

        model = str(tmp_path / "nope")
        shutil.copytree(tiny_llama_dir, model)
        config = json.loads((tmp_path / "nope" / "config.json").read_text())
        config["architectures"] = ["NopeForCausalLM"]
        (tmp_path / "nope" / "config.json").write_text(json.dumps(config))
        byte_level_tokenizer().save_pretrained(model)
        expected = "not supported by tokenmill"
    elif case == "no_platform":
        env["TOKENMILL_PLUGINS"] = "builtin_models"  # no platform plugin loaded
        expected = "no tokenmill platform plugin is installed"
    elif case == "conflict":
        env["TOKENMILL_CPUREF"] = "1"  # the example platform claims the CPU too
        expected = "more than one tokenmill platform plugin is active"
    else:
        fake_site.add_platform_plugin("fake-gamma", "gamma", "raise RuntimeError('driver exploded')")
        path = str(fake_site.root)
        expected = "detector raised"
    proc = _cli(["serve", model, "--port", "0"], env, path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(("tokenmill: error:", "tokenmill serve: error:"))]
    assert errors and expected in proc.stderr, proc.stderr[-2000:]
