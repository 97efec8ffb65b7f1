"""The public plugin API: one module, versioned, and the only tokenmill module plugins may import (that plugins
and examples import nothing else is checked in tests/architecture/test_import_layers.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import tokenmill.plugin_api as api
from tokenmill.plugins import PluginLoadError, get_platform_specs
from tokenmill.plugins.api_version import unmet_requirement

if TYPE_CHECKING:
    from conftest import FakeSite

ROOT = Path(__file__).resolve().parents[2]


def test_every_exported_name_resolves_and_names_are_documented() -> None:
    assert re.fullmatch(r"\d+\.\d+", api.VERSION)
    for name in api.__all__:
        assert getattr(api, name) is not None, name
    for needed in ("Platform", "PlatformSpec", "AttentionBackend", "AttentionImpl", "AttentionMetadata",
                   "write_kv_cache", "compute_slot_mapping", "GraphCapture", "EmulatedGraphCapture",
                   "QuantizedWeight", "FusedMoEMethod", "CustomOp", "CustomOpRegistry", "CausalLM", "ModelRegistry",
                   "hookimpl", "RMSNorm", "QKVParallelLinear", "get_rope", "DecoderLayer", "load_checkpoint_weights",
                   "get_tp_rank", "tp_all_reduce", "AttentionBackendRegistry", "TorchPagedAttentionImpl"):
        assert needed in api.__all__, needed
    with pytest.raises(AttributeError, match="public plugin API"):
        api.ModelRunner  # noqa: B018 - an internal name


def test_plugin_api_import_stays_light() -> None:
    """A platform plugin's entry-point module imports the API while platforms are chosen: no torch, no layers."""
    import subprocess
    import sys

    code = ("import sys; from tokenmill.plugin_api import PlatformSpec, hookimpl; "
            "print(sorted(m for m in ('torch', 'tokenmill.layers', 'tokenmill.worker') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_requirement_check() -> None:
    assert unmet_requirement(">=1.0,<2", "1.0") is None
    assert unmet_requirement("1.0", "1.3") is None  # a bare version: same major, at least that minor
    assert "requires plugin API >=2" in unmet_requirement(">=2", "1.0")
    assert "requires plugin API 1.4" in unmet_requirement("1.4", "1.3")
    assert unmet_requirement("1.0", "2.0") is not None
    assert "not a valid version specifier" in unmet_requirement("banana", "1.0")
    assert "must be a version specifier string" in unmet_requirement(2, "1.0")


PLATFORM_WITH_REQUIREMENT = """
from tokenmill.plugin_api import Platform, PlatformSpec, hookimpl

TOKENMILL_PLUGIN_API = {requirement!r}


class NewPlatform(Platform):
    name = "newchip"


@hookimpl
def tokenmill_platform():
    return PlatformSpec(name="newchip", detect=lambda: True, platform_cls=__name__ + ":NewPlatform")
"""


def test_a_plugin_needing_another_api_version_is_refused_by_name(fake_site: FakeSite) -> None:
    module = fake_site.unique_module("newchip")
    fake_site.add_module(module, PLATFORM_WITH_REQUIREMENT.format(requirement=">=2.0,<3"))
    fake_site.add_distribution("tokenmill-newchip", {"tokenmill.platforms": {"newchip": module}})
    with pytest.raises(PluginLoadError) as info:
        get_platform_specs()
    message = str(info.value)
    assert "'newchip'" in message and "tokenmill-newchip" in message
    assert "requires plugin API >=2.0,<3" in message and f"provides plugin API {api.VERSION}" in message


def test_a_plugin_whose_requirement_is_met_loads(fake_site: FakeSite) -> None:
    module = fake_site.unique_module("newchip")
    fake_site.add_module(module, PLATFORM_WITH_REQUIREMENT.format(requirement=api.VERSION))
    fake_site.add_distribution("tokenmill-newchip", {"tokenmill.platforms": {"newchip": module}})
    assert [s.name for s in get_platform_specs()] == ["newchip"]


def test_every_hook_is_documented_for_plugin_authors() -> None:
    import inspect

    from tokenmill.plugins import hookspecs

    docs = (ROOT / "docs/plugins.md").read_text()
    hooks = [n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("tokenmill_")]
    assert len(hooks) >= 7
    missing = [h for h in hooks if f"`{h}(" not in docs]
    assert not missing, f"hooks not described in docs/plugins.md: {missing}"


def test_docs_and_docstrings_stand_alone() -> None:
    """No pointer to a design document users do not have."""
    offenders = []
    for folder in ("docs", "framework", "models", "entrypoints", "plugins", "examples"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".toml") and "build" not in path.parts:
                text = path.read_text(errors="replace")
                if "DESIGN.md" in text or "../shared" in text:
                    offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders
