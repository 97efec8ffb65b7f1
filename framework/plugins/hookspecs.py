"""The hooks a tokenmill plugin may implement.

A plugin is a module named by an entry point. Platform plugins (group ``tokenmill.platforms``) implement
:func:`tokenmill_platform`; every other hook belongs in a module of group ``tokenmill.plugins``. Hook
functions are plain module-level functions decorated with :data:`hookimpl`::

    from tokenmill.plugin_api import hookimpl

    @hookimpl
    def tokenmill_register_models(registry):
        registry.register_model("MyForCausalLM", "my_pkg.model:MyForCausalLM")
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from tokenmill.platforms.interface import PlatformSpec

PROJECT_NAME = "tokenmill"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def tokenmill_platform() -> PlatformSpec:  # type: ignore[empty-body]
    """Describe the platform this plugin provides.

    Must be cheap: return a :class:`~tokenmill.platforms.PlatformSpec` (its ``detect`` runs later, and only
    when the user did not name a platform). Never import heavy modules or touch a device here.
    """


@hookspec
def tokenmill_register_models(registry: Any) -> None:
    """Register model architectures: call ``registry.register_model(arch, "module:Class")``.

    ``registry`` is :class:`tokenmill.model_loader.ModelRegistry`. Prefer ``"module:Class"`` strings so
    nothing is imported until the architecture is used.
    """


@hookspec
def tokenmill_register_attention_backends(registry: Any) -> None:
    """Register attention backends: call ``registry.register_backend(name, "module:Class")``.

    ``registry`` is :class:`tokenmill.attention.registry.AttentionBackendRegistry`.
    """


@hookspec
def tokenmill_add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add command-line flags of the plugin to ``parser`` (the ``tokenmill`` CLI's sub-command parser)."""


@hookspec
def tokenmill_register_tool_parsers(registry: Any) -> None:
    """Register tool-call parsers (for ``--enable-auto-tool-choice --tool-call-parser NAME``): call
    ``registry.register_tool_parser(name, "module:Class")`` with a subclass of
    :class:`tokenmill.tool_parsers.ToolParser`.

    ``registry`` is :class:`tokenmill.tool_parsers.ToolParserManager`.
    """


@hookspec
def tokenmill_register_custom_ops(registry: Any) -> None:
    """Replace layers without editing model code: call ``registry.register_op(name, "module:Class")`` with an
    op name of :data:`tokenmill.plugin_api.CUSTOM_OPS` (``"rms_norm"``, ``"rotary_embedding"``,
    ``"fused_moe"``, ``"quant_linear.int8"``, ...) and a subclass of that op's built-in class.

    Applies on every platform; a platform plugin that replaces an op only for its own hardware returns it from
    ``Platform.get_custom_op_cls(name)`` instead. ``registry`` is
    :class:`tokenmill.plugin_api.CustomOpRegistry`.
    """


@hookspec
def tokenmill_init_process(process: str) -> None:
    """Called once in every tokenmill process, right after the plugins are loaded and before any model is
    built: the place for patches and process-wide registrations (vLLM's "general plugins").

    Args:
        process: what the process is: ``"api_server"`` (``tokenmill serve``), ``"engine_core"`` (an engine
            core in its own process), ``"worker"`` (a tensor-parallel worker process or Ray actor),
            ``"offline"`` (a script using ``tokenmill.LLM``), ``"compile_worker"`` (the background process of
            ``--compile-mode background`` that compiles forward passes ahead of time) or ``"cli"`` (other
            ``tokenmill`` commands).
    """


@hookspec
def tokenmill_register_logits_processors(registry: Any) -> None:
    """Register logits processors that every engine runs before sampling: call
    ``registry.register_logits_processor(name, "module:Class")`` with a subclass of
    :class:`tokenmill.plugin_api.LogitsProcessor` (it reads per-request settings from
    ``SamplingParams.extra_args``). ``registry`` is :class:`tokenmill.plugin_api.LogitsProcessorRegistry`.
    """
