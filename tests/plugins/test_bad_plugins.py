"""What a plugin author meets when a plugin is wrong: a misspelled hook, two platforms of one name, two plugins
registering one name, a module with no hooks (or shadowed by another of its name), a registration hook that
raises, a backend name nothing registered. Each is named, with its entry point and distribution, both at
start-up and in ``tokenmill plugins``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from tokenmill.attention.registry import UnknownAttentionBackendError
from tokenmill.attention.selector import select_attn_backend
from tokenmill.entrypoints.cli import main
from tokenmill.model_loader import ModelRegistry
from tokenmill.model_loader.registry import UnknownArchitectureError
from tokenmill.platforms import Platform, get_current_platform
from tokenmill.plugins import PluginLoadError, get_platform_specs

if TYPE_CHECKING:
    from conftest import FakeSite

HOOK = "from tokenmill.plugin_api import hookimpl\n\n"


def _diagnosis(capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["plugins", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _entry(d: dict, dist: str) -> dict:
    return d["distributions"][dist]["entry_points"][0]


def test_misspelled_hook_fails_that_plugin_by_name(fake_site: FakeSite, capsys: pytest.CaptureFixture[str]) -> None:
    fake_site.add_platform_plugin("fake-alpha", "alpha", "return True, 'here'")
    module = fake_site.unique_module("typo")
    fake_site.add_module(module, HOOK + "@hookimpl\ndef tokenmill_register_modelz(registry):\n    pass\n")
    fake_site.add_distribution("fake-typo", {"tokenmill.plugins": {"typo": module}})
    with pytest.raises(PluginLoadError) as info:
        get_platform_specs()
    assert "'typo'" in str(info.value) and "fake-typo" in str(info.value)
    assert "tokenmill_register_modelz" in str(info.value) and "optionalhook" in str(info.value)
    d = _diagnosis(capsys)
    ep = _entry(d, "fake-typo")
    assert not ep["loaded"] and "tokenmill_register_modelz" in ep["error"]
    assert _entry(d, "fake-alpha")["loaded"] and d["selection"]["selected"] == "alpha"


def test_optional_unknown_hook_is_allowed(fake_site: FakeSite) -> None:
    module = fake_site.unique_module("optional")
    fake_site.add_module(module, HOOK + "@hookimpl(optionalhook=True)\ndef tokenmill_future_hook(x):\n    pass\n"
                                 "\n@hookimpl\ndef tokenmill_register_models(registry):\n    pass\n")
    fake_site.add_distribution("fake-optional", {"tokenmill.plugins": {"optional": module}})
    assert ModelRegistry.get_supported_archs() is not None  # loads without error


def test_two_platforms_with_one_name_is_an_error(fake_site: FakeSite, capsys: pytest.CaptureFixture[str]) -> None:
    fake_site.add_platform_plugin("fake-one", "one", "return True, 'one'", name="chip")
    fake_site.add_platform_plugin("fake-two", "two", "return False, 'two'", name="chip")
    with pytest.raises(PluginLoadError) as info:
        get_platform_specs()
    message = str(info.value)
    assert "both named 'chip'" in message and "fake-one" in message and "fake-two" in message
    d = _diagnosis(capsys)
    assert _entry(d, "fake-one")["loaded"] and not _entry(d, "fake-two")["loaded"]
    assert [p["name"] for p in d["platforms"]] == ["chip"]
    assert any("both named 'chip'" in w for w in d["warnings"])


def test_two_plugins_registering_one_architecture_warn(fake_site: FakeSite,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for dist, target in (("fake-a", "a_mod:A"), ("fake-b", "b_mod:B")):
        module = fake_site.unique_module(dist.replace("-", "_"))
        fake_site.add_module(module, HOOK + "@hookimpl\ndef tokenmill_register_models(registry):\n"
                                     f"    registry.register_model('SameForCausalLM', {target!r})\n")
        fake_site.add_distribution(dist, {"tokenmill.plugins": {dist[-1]: module}})
    fake_site.add_platform_plugin("fake-alpha", "alpha", "return True, 'here'")
    d = _diagnosis(capsys)
    assert d["architectures"]["SameForCausalLM"]["target"] == "b_mod:B"  # loaded later (distribution order)
    conflict = [w for w in d["warnings"] if "registered twice" in w]
    assert len(conflict) == 1 and "'b_mod:B'" in conflict[0] and "'a_mod:A'" in conflict[0]
    assert "tokenmill.plugins:a" in conflict[0] and "tokenmill.plugins:b" in conflict[0]


def test_module_without_hooks_is_a_warning_and_a_hint(fake_site: FakeSite,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    module = fake_site.unique_module("nohooks")
    fake_site.add_module(module, "def tokenmill_register_models(registry):  # no @hookimpl\n"
                                 "    registry.register_model('NoHookForCausalLM', 'x:Y')\n")
    fake_site.add_distribution("fake-nohooks", {"tokenmill.plugins": {"nohooks": module}})
    with pytest.raises(UnknownArchitectureError, match="implements no tokenmill hook"):
        ModelRegistry.resolve_model_cls(["NoHookForCausalLM"])
    d = _diagnosis(capsys)
    assert any("'nohooks'" in w and "implements no tokenmill hook" in w and module in w for w in d["warnings"])


def test_registration_hook_that_raises_is_a_warning_and_stops_startup(
        fake_site: FakeSite, capsys: pytest.CaptureFixture[str]) -> None:
    module = fake_site.unique_module("raising")
    fake_site.add_module(module, HOOK + "@hookimpl\ndef tokenmill_register_custom_ops(registry):\n"
                                 "    raise RuntimeError('registration exploded')\n")
    fake_site.add_distribution("fake-raising", {"tokenmill.plugins": {"raising": module}})
    fake_site.add_platform_plugin("fake-alpha", "alpha", "return True, 'here'")
    d = _diagnosis(capsys)  # never fails because a plugin is broken
    assert "error" in d["custom_ops"]
    assert any("registration exploded" in w and "tokenmill.plugins:raising" in w for w in d["warnings"])
    from tokenmill.layers.custom_op import CustomOpRegistry

    with pytest.raises(PluginLoadError, match="registration exploded"):
        CustomOpRegistry.get_registered_ops()


def test_unknown_backend_name_names_the_platform_that_chose_it(fake_site: FakeSite) -> None:
    class Chip(Platform):
        name = "chip"

        @classmethod
        def get_attn_backend_cls(cls, config: object) -> str:
            return "NO_SUCH_BACKEND"

    with pytest.raises(UnknownAttentionBackendError, match="NO_SUCH_BACKEND.*platform chip"):
        select_attn_backend(Chip, object())
    assert get_current_platform is not None
