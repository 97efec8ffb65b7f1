"""tokenmill's layers, the deliberate exceptions, and what a plugin may import.

The same table, with the reasons for each placement, is in docs/architecture.md ("Layers"); a test checks that
the two agree. A module belongs to the layer of the longest prefix of its name listed in :data:`LAYER_OF`; a
module no prefix covers is an error (a new subpackage must be placed).
"""

from __future__ import annotations

LAYERS = ("foundation", "platform", "model", "engine", "entrypoints")

# Prefix (relative to ``tokenmill``) -> layer.
LAYER_OF: dict[str, str] = {
    # config/errors/outputs: plain values every layer may use.
    "config": "foundation",
    "errors": "foundation",
    "outputs": "foundation",
    "sampling_params": "foundation",
    "pooling_params": "foundation",
    "pooler_config": "foundation",
    "lora.request": "foundation",
    "cache_dir": "foundation",
    "dtypes": "foundation",
    "version": "foundation",
    "process_exit": "foundation",
    # platforms/plugins: the plugin core, and the per-process state the device layers read.
    "platforms": "platform",
    "plugins": "platform",
    "distributed": "platform",
    "forward_context": "platform",
    # layers/attention/model_loader: what a model is made of and how it is loaded.
    "layers": "model",
    "attention": "model",
    "model_loader": "model",
    "model_contract": "model",
    "models": "model",
    "lora": "model",
    "tokenizer": "model",
    "tool_parsers": "model",
    "reasoning": "model",
    "multimodal": "model",
    # core/worker/engine: scheduling, execution, the engine and its configuration.
    "core": "engine",
    "worker": "engine",
    "engine": "engine",
    "engine_args": "engine",
    "executor": "engine",
    "spec_decode": "engine",
    "structured_output": "engine",
    "metrics": "engine",
    "conformance": "engine",
    "plugin_api": "engine",
    # entrypoints: the CLI, the offline LLM class, the HTTP server.
    "entrypoints": "entrypoints",
}

# The root package ``tokenmill`` (its ``__init__``) re-exports the offline ``LLM`` class, so it sits on top.
ROOT_LAYER = "entrypoints"

# (importer, imported) -> why a lower layer may import a higher one here. Keep it short: each entry is a
# design decision, not a convenience.
ALLOWED_BACK_EDGES: dict[tuple[str, str], str] = {}

# What a plugin (plugins/*, examples/*) may import from tokenmill (docs/plugins.md).
PUBLIC_PLUGIN_MODULES = frozenset({
    "tokenmill",
    "tokenmill.plugin_api",
    "tokenmill.conformance",
    "tokenmill.conformance.pytest_plugin",
})


def layer_of(module: str) -> str | None:
    """The layer of the ``tokenmill`` module ``module`` (``None`` if no prefix of :data:`LAYER_OF` covers it)."""
    if module != "tokenmill" and not module.startswith("tokenmill."):
        raise ValueError(f"{module} is not a tokenmill module")
    if module == "tokenmill":
        return ROOT_LAYER
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYER_OF:
            return LAYER_OF[prefix]
    return None


def rank(layer: str) -> int:
    return LAYERS.index(layer)
