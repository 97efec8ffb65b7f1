"""ModelRegistry and AttentionBackendRegistry: script registrations, plugin hooks, errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from tokenmill.attention.registry import AttentionBackendRegistry, UnknownAttentionBackendError
from tokenmill.model_loader import ModelRegistry
from tokenmill.model_loader.registry import UnknownArchitectureError

if TYPE_CHECKING:
    from conftest import FakeSite


class ScriptModel(torch.nn.Module):
    pass


def test_builtin_models_plugin_registers_llama(clean_plugin_state: None) -> None:
    assert ModelRegistry.is_registered("LlamaForCausalLM")


def test_script_registration_wins_and_survives_plugin_reload(fake_site: FakeSite) -> None:
    module = fake_site.unique_module("models")
    fake_site.add_module(
        module,
        """
        from tokenmill.plugins import hookimpl

        @hookimpl
        def tokenmill_register_models(registry):
            registry.register_model("ScriptModel", "collections:OrderedDict")
        """,
    )
    fake_site.add_distribution("fake-models", {"tokenmill.plugins": {"models": module}})
    assert ModelRegistry.resolve_model_cls(["ScriptModel"]).__name__ == "OrderedDict"
    ModelRegistry.register_model("ScriptModel", ScriptModel)
    assert ModelRegistry.resolve_model_cls(["ScriptModel"]) is ScriptModel
    from tokenmill.plugins import reset_for_tests

    reset_for_tests([fake_site.root])  # e.g. plugins reloaded: script registrations stay on top
    assert ModelRegistry.resolve_model_cls(["ScriptModel"]) is ScriptModel


def test_register_model_validates_arguments(clean_plugin_state: None) -> None:
    with pytest.raises(ValueError, match="module:Class"):
        ModelRegistry.register_model("X", "no_colon_here")
    with pytest.raises(TypeError):
        ModelRegistry.register_model("", ScriptModel)
    with pytest.raises(TypeError):
        ModelRegistry.register_model("X", 42)  # type: ignore[arg-type]


def test_bad_paths_fail_clearly(clean_plugin_state: None) -> None:
    ModelRegistry.register_model("Missing", "no_such_module_xyz:Model")
    with pytest.raises(ImportError, match="'Missing'"):
        ModelRegistry.resolve_model_cls(["Missing"])
    ModelRegistry.register_model("NotAClass", "os.path:join")
    with pytest.raises(TypeError, match="not a class"):
        ModelRegistry.resolve_model_cls(["NotAClass"])


def test_empty_architectures(clean_plugin_state: None) -> None:
    with pytest.raises(UnknownArchitectureError, match="lists no architectures"):
        ModelRegistry.resolve_model_cls([])


def test_attention_backend_from_plugin(fake_site: FakeSite) -> None:
    module = fake_site.unique_module("attn")
    fake_site.add_module(
        module,
        """
        from tokenmill.plugins import hookimpl

        class FancyBackend:
            pass

        @hookimpl
        def tokenmill_register_attention_backends(registry):
            registry.register_backend("fancy", __name__ + ":FancyBackend")
        """,
    )
    fake_site.add_distribution("fake-attn", {"tokenmill.plugins": {"attn": module}})
    assert AttentionBackendRegistry.get_backend_names() == ["FANCY", "TORCH_PAGED", "TRITON_PAGED"]
    assert AttentionBackendRegistry.resolve_backend_cls("fancy").__name__ == "FancyBackend"  # any case
    assert AttentionBackendRegistry.get_backend_path("FANCY") == f"{module}:FancyBackend"
    assert AttentionBackendRegistry.source_of("fancy") == "plugin tokenmill.plugins:attn"
    assert AttentionBackendRegistry.source_of("TORCH_PAGED") == "builtin"
    with pytest.raises(UnknownAttentionBackendError, match="FANCY, TORCH_PAGED, TRITON_PAGED"):
        AttentionBackendRegistry.get_backend_path("nope")


def test_attention_backend_class_registration(clean_plugin_state: None) -> None:
    AttentionBackendRegistry.register_backend("script", ScriptModel)
    assert AttentionBackendRegistry.get_backend_path("script") == f"{__name__}:ScriptModel"
