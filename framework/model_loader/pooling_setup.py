"""Which runner a checkpoint gets (generation or pooling) and its pooler, from the architecture and the
sentence-transformers files shipped with it (``modules.json``, the pooling module's ``config.json``,
``config_sentence_transformers.json``), so that serving an embedding model needs no flags.

The sentence-transformers layout is read as its documentation describes it: ``modules.json`` lists the
modules in order (``Transformer``, ``Pooling``, optionally ``Normalize``), the pooling module's directory holds
``pooling_mode_*`` flags, and ``config_sentence_transformers.json`` named ``prompts``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from tokenmill.pooler_config import PoolerConfig

RUNNER_TYPES = ("auto", "generate", "pooling")
CONVERT_TYPES = ("auto", "none", "embed", "classify")

# Architectures with no LM head: they can only be pooled. Encoder-only ones are also bidirectional.
ENCODER_ARCHITECTURES = frozenset({
    "BertModel", "XLMRobertaModel", "BertForSequenceClassification", "XLMRobertaForSequenceClassification",
})
EMBEDDING_ARCHITECTURES = frozenset({"BertModel", "XLMRobertaModel", "Qwen3Model", "Qwen2Model", "LlamaModel"})

_ST_POOLING_MODES = (
    ("pooling_mode_lasttoken", "LAST"),
    ("pooling_mode_cls_token", "CLS"),
    ("pooling_mode_mean_tokens", "MEAN"),
)


@dataclass
class RunnerChoice:
    """The resolved runner of a model.

    Attributes:
        runner_type: ``"generate"`` or ``"pooling"``.
        convert: ``"none"`` (generation), ``"embed"`` or ``"classify"``.
        pooler_config: the pooler (``None`` for generation).
        encoder_only: a bidirectional encoder (whole prompts per step, no prefix caching).
    """

    runner_type: str
    convert: str
    pooler_config: PoolerConfig | None = None
    encoder_only: bool = False


def resolve_runner(model_dir: str, hf_config: Any, runner: str = "auto", convert: str = "auto") -> RunnerChoice:
    """Pick the runner, the conversion and the pooler of a model.

    Args:
        model_dir: the checkpoint directory (sentence-transformers files are looked for there).
        hf_config: the model's transformers config.
        runner: ``--runner`` (``"auto"``: from the architecture and the files).
        convert: ``--convert`` (``"auto"``: ``classify`` for ``*ForSequenceClassification``, else ``embed``).

    Raises:
        ValueError: an unknown value, a pooling-only architecture asked to generate, a conversion that does not
            fit the architecture, or a sentence-transformers pipeline tokenmill cannot reproduce (e.g. a
            ``Dense`` module, or max/weighted-mean pooling).
    """
    if runner not in RUNNER_TYPES:
        raise ValueError(f"runner: must be one of {', '.join(RUNNER_TYPES)}, got {runner!r}")
    if convert not in CONVERT_TYPES:
        raise ValueError(f"convert: must be one of {', '.join(CONVERT_TYPES)}, got {convert!r}")
    archs = list(getattr(hf_config, "architectures", None) or [])
    arch = archs[0] if archs else ""
    is_classifier = arch.endswith("ForSequenceClassification")
    pooling_only = is_classifier or arch in EMBEDDING_ARCHITECTURES
    st_modules = _read_json(os.path.join(model_dir, "modules.json")) if model_dir else None
    if convert in ("embed", "classify") and runner == "generate":
        raise ValueError(f"convert: --convert {convert} needs the pooling runner, not --runner generate")
    if runner == "generate" or (runner == "auto" and convert in ("auto", "none") and not pooling_only
                                and st_modules is None):
        if pooling_only:
            raise ValueError(
                f"runner: {arch} is a pooling model (embeddings / classification) and cannot generate; "
                "serve it with --runner pooling (the default for it)"
            )
        if convert not in ("auto", "none"):
            raise ValueError(f"convert: --convert {convert} needs --runner pooling")
        return RunnerChoice("generate", "none")
    if convert in ("auto", "none"):
        convert = "classify" if is_classifier else "embed"
    if convert == "classify" and not is_classifier:
        raise ValueError(f"convert: {arch or 'this model'} has no classification head (a "
                         "*ForSequenceClassification checkpoint is needed for --convert classify)")
    default_type = "CLS" if arch in ENCODER_ARCHITECTURES else "LAST"
    pooler = PoolerConfig(pooling_type=default_type, matryoshka_dimensions=_matryoshka(hf_config, model_dir))
    if convert == "embed" and st_modules is not None:
        _apply_sentence_transformers(pooler, model_dir, st_modules)
    return RunnerChoice("pooling", convert, pooler, encoder_only=arch in ENCODER_ARCHITECTURES)


def is_encoder_only(hf_config: Any) -> bool:
    """Whether the model is an encoder with bidirectional attention (BERT, XLM-RoBERTa)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    return bool(archs) and archs[0] in ENCODER_ARCHITECTURES


def _apply_sentence_transformers(pooler: PoolerConfig, model_dir: str, modules: Any) -> None:
    types = [str(m.get("type", "")) for m in modules]
    unsupported = [t for t in types if t.rsplit(".", 1)[-1] not in ("Transformer", "Pooling", "Normalize")]
    if unsupported:
        raise ValueError(
            f"{model_dir}/modules.json: sentence-transformers modules {unsupported} are not supported (tokenmill "
            "runs Transformer, Pooling and Normalize)"
        )
    pooler.normalize = any(t.endswith("Normalize") for t in types)
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            cfg = _read_json(os.path.join(model_dir, str(module.get("path", "")), "config.json")) or {}
            modes = [name for key, name in _ST_POOLING_MODES if cfg.get(key)]
            others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v
                      and k not in dict(_ST_POOLING_MODES)]
            if others or len(modes) != 1:
                raise ValueError(f"{model_dir}: sentence-transformers pooling {others or modes} is not supported "
                                 "(one of lasttoken, cls_token, mean_tokens is)")
            pooler.pooling_type = modes[0]
    st_config = _read_json(os.path.join(model_dir, "config_sentence_transformers.json")) or {}
    if st_config.get("prompts"):
        pooler.prompts = {str(k): str(v) for k, v in st_config["prompts"].items()}
    pooler.default_prompt_name = st_config.get("default_prompt_name") or None


def _matryoshka(hf_config: Any, model_dir: str) -> list[int] | None:
    """``matryoshka_dimensions`` (or ``[]`` for ``is_matryoshka``) from config.json, else ``None``."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return [int(d) for d in dims]
    return [] if getattr(hf_config, "is_matryoshka", False) else None


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
