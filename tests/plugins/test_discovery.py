"""Plugin discovery and platform selection with fake distributions (see conftest.FakeSite)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import pytest

from tokenmill.model_loader import ModelRegistry
from tokenmill.model_loader.registry import UnknownArchitectureError
from tokenmill.platforms import (
    NoPlatformError,
    PlatformConflictError,
    PlatformDetectionError,
    UnknownPlatformError,
    current_platform,
    get_current_platform,
    resolve_platform,
    set_current_platform,
)
from tokenmill.plugins import PluginLoadError, get_platform_specs, load_generation
from tokenmill.plugins import manager as plugin_manager

if TYPE_CHECKING:
    from conftest import FakeSite  # the fixture's type (tests/plugins/conftest.py)

ACTIVE = "return True, 'fake hardware present'"
DECLINED = "return False, 'no fake hardware here'"

TINY_MODEL_MODULE = """
import torch

from tokenmill.plugins import hookimpl


class TinyForCausalLM(torch.nn.Module):
    def __init__(self, config=None, prefix=""):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)


@hookimpl
def tokenmill_register_models(registry):
    registry.register_model("TinyForCausalLM", __name__ + ":TinyForCausalLM")
"""


def test_only_fake_site_is_discovered(fake_site: FakeSite) -> None:
    fake_site.add_platform_plugin("fake-alpha", "alpha", ACTIVE)
    assert [(s.name, s.entry_point, s.distribution) for s in get_platform_specs()] == [
        ("alpha", "alpha", "fake-alpha")
    ]


def test_single_active_platform_is_chosen(fake_site: FakeSite) -> None:
    module = fake_site.add_platform_plugin("fake-alpha", "alpha", ACTIVE)
    fake_site.add_platform_plugin("fake-beta", "beta", DECLINED)
    cls = resolve_platform()
    assert cls.name == "alpha"
    assert cls.__module__ == module


def test_two_active_platforms_conflict(fake_site: FakeSite) -> None:
    fake_site.add_platform_plugin("fake-alpha", "alpha", ACTIVE)
    fake_site.add_platform_plugin("fake-beta", "beta", ACTIVE)
    with pytest.raises(PlatformConflictError) as info:
        resolve_platform()
    message = str(info.value)
    for expected in ("alpha", "beta", "fake-alpha", "fake-beta", "--platform", "TOKENMILL_PLATFORM", "uninstall"):
        assert expected in message


def test_no_active_platform_lists_each_plugin_and_reason(fake_site: FakeSite) -> None:
    fake_site.add_platform_plugin("fake-alpha", "alpha", "return False, 'alpha card missing'")
    fake_site.add_platform_plugin("fake-beta", "beta", "return False")
    with pytest.raises(NoPlatformError) as info:
        resolve_platform()
    message = str(info.value)
    assert "alpha card missing" in message
    assert "fake-alpha" in message and "fake-beta" in message
    assert "no reason given" in message
    assert "pip install tokenmill-cpu" in message


def test_no_platform_plugin_installed(fake_site: FakeSite) -> None:
    with pytest.raises(NoPlatformError, match="no tokenmill platform plugin is installed"):
        resolve_platform()


def test_detector_exception_stops_startup_when_none_active(fake_site: FakeSite) -> None:
    fake_site.add_platform_plugin("fake-alpha", "alpha", "raise RuntimeError('driver exploded')")
    fake_site.add_platform_plugin("fake-beta", "beta", DECLINED)
    with pytest.raises(PlatformDetectionError) as info:
        resolve_platform()
    assert "RuntimeError: driver exploded" in str(info.value)
    assert "fake-alpha" in str(info.value) and "--platform alpha" in str(info.value)


def test_detector_exception_stops_startup_even_when_another_is_active(fake_site: FakeSite) -> None:
    """The decided rule: no silent fallback to the other platform (the failing one may be the GPU the user
    wants); the error names both and says how to choose."""
    fake_site.add_platform_plugin("fake-alpha", "alpha", "raise RuntimeError('driver exploded')")
    fake_site.add_platform_plugin("fake-beta", "beta", ACTIVE)
    with pytest.raises(PlatformDetectionError) as info:
        resolve_platform()
    message = str(info.value)
    assert "driver exploded" in message and "fake-alpha" in message
    assert "Active: beta" in message and "--platform beta" in message and "tokenmill plugins" in message
    assert resolve_platform("beta").name == "beta"  # naming the platform skips the failing detector


def test_detector_returning_garbage_is_reported(fake_site: FakeSite) -> None:
    fake_site.add_platform_plugin("fake-alpha", "alpha", "return 'yes'")
    with pytest.raises(PlatformDetectionError, match="expected a bool or a"):
        resolve_platform()


@pytest.mark.parametrize("how", ["env", "argument", "entry_point_name"])
def test_named_platform_skips_other_detectors(
    fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    alpha = fake_site.add_platform_plugin("fake-alpha", "alpha", ACTIVE)
    beta = fake_site.add_platform_plugin("fake-beta", "beta_ep", ACTIVE, name="beta")
    if how == "env":
        monkeypatch.setenv("TOKENMILL_PLATFORM", "beta")
        cls = resolve_platform()
    elif how == "argument":
        cls = resolve_platform("beta")
    else:
        cls = resolve_platform("beta_ep")
    assert cls.name == "beta"
    assert sys.modules[alpha].DETECT_CALLS == []
    assert sys.modules[beta].DETECT_CALLS == []  # a named platform is trusted, not detected


def test_auto_means_detect(fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_site.add_platform_plugin("fake-alpha", "alpha", ACTIVE)
    monkeypatch.setenv("TOKENMILL_PLATFORM", "auto")
    assert resolve_platform().name == "alpha"


def test_unknown_platform_name_lists_available(fake_site: FakeSite) -> None:
    fake_site.add_platform_plugin("fake-alpha", "alpha", ACTIVE)
    with pytest.raises(UnknownPlatformError) as info:
        resolve_platform("gamma")
    assert "'gamma'" in str(info.value)
    assert "alpha (fake-alpha)" in str(info.value)


def test_tokenmill_plugins_filter_excludes_plugin(fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_site.add_platform_plugin("fake-alpha", "alpha", ACTIVE)
    beta = fake_site.add_platform_plugin("fake-beta", "beta", ACTIVE)
    monkeypatch.setenv("TOKENMILL_PLUGINS", "alpha, other")
    plugin_manager.reset_for_tests([fake_site.root])
    assert [s.name for s in get_platform_specs()] == ["alpha"]
    assert resolve_platform().name == "alpha"
    assert beta not in sys.modules  # excluded plugins are not even imported
    with pytest.raises(UnknownPlatformError, match="TOKENMILL_PLUGINS leaves them out: beta"):
        resolve_platform("beta")


def test_failing_import_names_entry_point_and_distribution(fake_site: FakeSite) -> None:
    module = fake_site.unique_module("broken")
    fake_site.add_module(module, "raise ImportError('needs libfoo.so')\n")
    fake_site.add_distribution("fake-broken", {"tokenmill.plugins": {"broken_ep": module}})
    with pytest.raises(PluginLoadError) as info:
        ModelRegistry.get_supported_archs()
    message = str(info.value)
    assert "'broken_ep'" in message and "fake-broken" in message and "needs libfoo.so" in message


def test_platform_module_without_hook_is_an_error(fake_site: FakeSite) -> None:
    module = fake_site.unique_module("hookless")
    fake_site.add_module(module, "X = 1\n")
    fake_site.add_distribution("fake-hookless", {"tokenmill.platforms": {"hookless": module}})
    with pytest.raises(PluginLoadError, match="no tokenmill_platform"):
        get_platform_specs()


def test_misspelled_hook_is_an_error(fake_site: FakeSite) -> None:
    module = fake_site.unique_module("typo")
    fake_site.add_module(
        module,
        "from tokenmill.plugins import hookimpl\n\n@hookimpl\ndef tokenmill_register_model(registry):\n    pass\n",
    )
    fake_site.add_distribution("fake-typo", {"tokenmill.plugins": {"typo": module}})
    with pytest.raises(PluginLoadError, match="tokenmill_register_model"):
        get_platform_specs()


def test_model_plugin_architecture_resolves(fake_site: FakeSite) -> None:
    module = fake_site.unique_module("tiny_model")
    fake_site.add_module(module, TINY_MODEL_MODULE)
    fake_site.add_distribution("fake-models", {"tokenmill.plugins": {"tiny": module}})
    assert ModelRegistry.is_registered("TinyForCausalLM")
    assert "TinyForCausalLM" in ModelRegistry.get_supported_archs()
    cls = ModelRegistry.resolve_model_cls(["NotThere", "TinyForCausalLM"])
    assert cls.__name__ == "TinyForCausalLM" and cls.__module__ == module
    import torch

    assert isinstance(cls(), torch.nn.Module)


def test_unknown_architecture_lists_known_ones(fake_site: FakeSite) -> None:
    module = fake_site.unique_module("tiny_model")
    fake_site.add_module(module, TINY_MODEL_MODULE)
    fake_site.add_distribution("fake-models", {"tokenmill.plugins": {"tiny": module}})
    with pytest.raises(UnknownArchitectureError) as info:
        ModelRegistry.resolve_model_cls(["MysteryForCausalLM"])
    message = str(info.value)
    assert "MysteryForCausalLM" in message
    assert "TinyForCausalLM" in message
    assert "tokenmill.plugins" in message and "tokenmill_register_models" in message
    assert "same process" in message


def test_plugins_reload_in_a_new_process(fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_site.add_platform_plugin("fake-alpha", "alpha", ACTIVE)
    first = load_generation()
    assert load_generation() == first  # loaded once per process
    child_pid = os.getpid() + 100_000
    monkeypatch.setattr(plugin_manager.os, "getpid", lambda: child_pid)
    assert load_generation() == first + 1  # a forked child (new PID) loads the plugins again


def test_current_platform_proxy_and_setter(fake_site: FakeSite, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_site.add_platform_plugin("fake-alpha", "alpha", ACTIVE)
    fake_site.add_platform_plugin("fake-beta", "beta", ACTIVE)
    assert "not resolved" in repr(current_platform)
    with pytest.raises(PlatformConflictError):
        _ = current_platform.name
    monkeypatch.setenv("TOKENMILL_PLATFORM", "")  # monkeypatch restores it after set_current_platform
    set_current_platform("beta")
    assert current_platform.name == "beta"
    assert get_current_platform().name == "beta"
    assert os.environ["TOKENMILL_PLATFORM"] == "beta"  # child processes pick the same platform
