"""The conformance kit on the in-tree platforms (cpu on this machine, cuda and rocm on an emulated device), on
the out-of-tree example platform, and on deliberately broken backends, which must fail naming the item."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.conformance import CONTRACT_ITEMS, ConformanceReport, run_conformance

ROOT = Path(__file__).resolve().parents[2]
BROKEN = "tests.conformance.broken_backends"
_REPORTS: dict[str, ConformanceReport] = {}


def report_for(name: str) -> ConformanceReport:
    if name not in _REPORTS:
        _REPORTS[name] = run_conformance(name)
    return _REPORTS[name]


def statuses(report: ConformanceReport) -> dict[str, str]:
    return {r.item: r.status for r in report.results}


def _assert_conforms(report: ConformanceReport) -> None:
    assert report.ok, report.format()
    assert [r.item for r in report.results] == list(CONTRACT_ITEMS)


def test_cpu_plugin_conforms(clean_plugin_state: None) -> None:
    report = report_for("cpu")
    _assert_conforms(report)
    assert report.mode == "real"
    s = statuses(report)
    assert s["graph_capture"] == "skip" and s["e2e.greedy"] == "pass" and s["attention.reference"] == "pass"
    assert s["attention.encoder_only"] == "pass" and s["attention.mm_prefix"] == "pass"
    assert "CPU_PAGED" in report.attention_backend
    custom = next(r for r in report.results if r.item == "custom_ops")
    assert s["custom_ops"] == "pass" and {n.split(":")[0] for n in custom.notes} >= {
        "causal_conv1d", "mamba_ssd", "gated_delta_rule", "unquantized_linear"}  # the C++ state kernels included


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cuda_plugin_conforms_on_an_emulated_device(clean_plugin_state: None) -> None:
    report = report_for("cuda")
    _assert_conforms(report)
    assert report.mode == "emulated" and "TRITON_PAGED" in report.attention_backend
    s = statuses(report)
    assert s["graph_capture"] == "pass"  # CUDA graphs claimed: replayed through the CPU capture emulator
    graphs = next(r for r in report.results if r.item == "graph_capture")
    assert any("EmulatedGraphCapture" in n for n in graphs.notes)
    assert s["kv_cache"] == "pass" and any("negative slots" in n for r in report.results for n in r.notes)
    assert s["attention.encoder_only"] == "pass"  # the Triton kernel without the causal mask
    assert s["attention.mm_prefix"] == "skip"  # no bidirectional spans in the Triton kernel


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_rocm_plugin_conforms_on_an_emulated_device(clean_plugin_state: None) -> None:
    report = report_for("rocm")
    _assert_conforms(report)
    assert report.mode == "emulated" and statuses(report)["graph_capture"] == "skip"


def test_example_platform_conforms(clean_plugin_state: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CPUREF", "1")
    report = run_conformance("cpuref")
    _assert_conforms(report)
    assert report.mode == "real" and report.plugin == "entry point 'cpuref' of distribution tokenmill-cpuref"
    custom = next(r for r in report.results if r.item == "custom_ops")
    assert custom.status == "pass" and "FunctionalRMSNorm" in custom.notes[0]
    memory = next(r for r in report.results if r.item == "memory")
    assert any("available accounting, cap 1.0 GiB" in n for n in memory.notes)  # its own KV sizing


@pytest.mark.parametrize("backend,item,words", [
    ("WrongScaleBackend", "attention.reference", "scale 0.3"),
    ("OffByOneSlotBackend", "kv_cache", "wrong slots"),
    ("LeakyEncoderBackend", "attention.encoder_only", "the 1-token sequence at rows 0..0"),
    ("CausalOnlyBackend", "attention.mm_prefix", "step 'fresh prefills', request A"),
    ("UnscaledInt8Backend", "attention.reference", "over a int8 cache"),
])
def test_broken_backends_fail_naming_the_item(clean_plugin_state: None, backend: str, item: str, words: str) -> None:
    report = run_conformance("cpu", attention_backend=f"{BROKEN}:{backend}",
                             items=["kv_cache", "attention.reference", "attention.encoder_only", "attention.mm_prefix"])
    assert not report.ok
    failed = {r.item: r.message for r in report.results if r.status == "fail"}
    assert item in failed and words in failed[item], report.format()
    assert f"FAIL {item}" in report.format().replace("FAIL ", "FAIL ", 1)
    if backend == "OffByOneSlotBackend":
        assert "attention.reference" in failed  # reads through the block table then see unwritten slots


def test_check_command_exit_status_and_report(tmp_path: Path) -> None:
    def check(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "plugins", "check", *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})

    bad = check("cpu", "--attention-backend", f"{BROKEN}:OffByOneSlotBackend", "--only", "kv_cache")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL kv_cache" in bad.stdout and "wrong slots" in bad.stdout and "DOES NOT CONFORM" in bad.stdout
    good = check("cpu", "--only", "platform.class", "memory", "--json")
    assert good.returncode == 0, good.stdout + good.stderr
    import json

    data = json.loads(good.stdout)
    assert data["ok"] and data["counts"] == {"pass": 2, "fail": 0, "skip": 0}


def test_pytest_plugin_runs_the_kit_as_tests(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tokenmill-platform",
                           "cpu", "--tokenmill-items", "platform.class,memory,graph_capture", "-rs"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "2 passed, 1 skipped" in proc.stdout and "graph_capture: the platform does not claim" in proc.stdout


DETECT_PLUGIN = """
from tokenmill.plugin_api import PlatformSpec, hookimpl


def detect():
    import {platform_module}  # noqa: F401 - what the contract forbids
    return "yes"


@hookimpl
def tokenmill_platform():
    return PlatformSpec(name="sloppy", detect=detect, platform_cls="{platform_module}:SloppyPlatform")
"""

PLATFORM = """
from tokenmill.plugin_api import Platform


class SloppyPlatform(Platform):
    name = "sloppy"
"""


def test_detect_item_names_what_the_detector_did_wrong(fake_site) -> None:  # noqa: ANN001
    platform_module = fake_site.unique_module("sloppy_platform")
    fake_site.add_module(platform_module, PLATFORM)
    plugin = fake_site.unique_module("sloppy_plugin")
    fake_site.add_module(plugin, DETECT_PLUGIN.format(platform_module=platform_module))
    fake_site.add_distribution("fake-sloppy", {"tokenmill.platforms": {"sloppy": plugin}})
    fake_site.use_all_distributions()
    report = run_conformance("sloppy", items=["detect"], device="real")
    result = report.results[0]
    assert result.status == "fail"
    assert "returned 'yes'" in result.message and f"imported the Platform class's module '{platform_module}'" in result.message


def test_memory_item_accepts_a_legitimately_small_kv_budget() -> None:
    """A platform whose cache budget is small (here 100 MiB) conforms: the kit's heavier-weights / hotter-activations
    probes scale with the budget instead of a fixed 256 MiB that would leave nothing."""
    from tokenmill.plugin_api import Platform

    class SmallBudget(Platform):
        name = "small_budget"
        device_type = "cpu"
        memory_accounting = "available"
        kv_cache_available_fraction = 0.1

        @classmethod
        def get_device_available_memory(cls, device_id: int = 0) -> int:
            return 1000 << 20

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 2 << 30

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "small"

        @classmethod
        def device_count(cls) -> int:
            return 1

    report = run_conformance(SmallBudget, device="real", items=["memory"])
    assert report.ok, report.format()
