"""Locate a model (directory, GGUF file or default) and read its transformers config."""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.model_loader.default_model import DEFAULT_SERVED_MODEL_NAME, default_model_path
from tokenmill.model_loader.gguf_cache import gguf_cache_dir, read_gguf_tensors, reuse_gguf_readers, save_atomically
from tokenmill.model_loader.gguf_hybrid import read_state_space_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelLocation:
    """Where a model's files are.

    Attributes:
        path: what the user named (directory or ``.gguf`` file), made absolute.
        directory: folder holding config/tokenizer files (the GGUF file's folder for GGUF).
        gguf_file: the GGUF file name inside ``directory``, or ``None``.
        default_served_name: the API's model name when ``--served-model-name`` is not given.
    """

    path: str
    directory: str
    gguf_file: str | None
    default_served_name: str


def resolve_model_location(model: str | None) -> ModelLocation:
    """Turn the user's MODEL argument into file locations.

    ``None`` is the embedded default model. A hub id (``org/name``) that is not a local path is fetched with
    ``huggingface_hub.snapshot_download`` when the network allows.

    Raises:
        FileNotFoundError: the path does not exist and is not a downloadable hub id.
        tokenmill.model_loader.default_model.DefaultModelMissingError: no model given and none embedded.
    """
    if model is None:
        path = default_model_path()
        return ModelLocation(path, os.path.dirname(path), os.path.basename(path), DEFAULT_SERVED_MODEL_NAME)
    expanded = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(expanded):
        if not expanded.endswith(".gguf"):
            raise FileNotFoundError(f"model: {model!r} is a file but not a .gguf file")
        return ModelLocation(expanded, os.path.dirname(expanded), os.path.basename(expanded), model)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise FileNotFoundError(f"model: directory {model!r} has no config.json (Hugging Face layout expected)")
        return ModelLocation(expanded, expanded, None, model)
    if model.count("/") == 1 and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
        except Exception as exc:  # noqa: BLE001 - reported with the cause below
            raise FileNotFoundError(
                f"model: {model!r} is not a local path and could not be downloaded from the Hugging Face hub "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        return ModelLocation(local, local, None, model)
    raise FileNotFoundError(f"model: {model!r} does not exist (expected a directory, a .gguf file or a hub id)")


# transformers' model_type of a GGUF-derived config -> tokenmill architecture
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def load_hf_config(directory: str, gguf_file: str | None, *, trust_remote_code: bool = False,
                   gguf_tokenizer: bool = False) -> Any:
    """Read the ``transformers`` config from ``config.json`` or from a GGUF file's metadata.

    A GGUF file's config is saved in the disk cache of :mod:`tokenmill.model_loader.gguf_cache` after its first
    read (the metadata walk takes seconds) and loaded from there afterwards. The first read also saves the
    file's tensor table (which the engine core's weight loader needs) and, with ``gguf_tokenizer``, converts
    and caches its tokenizer (:func:`tokenmill.tokenizer.load_tokenizer`; a failure there is left for the
    tokenizer's own load to report), all from one ``gguf.GGUFReader`` (:func:`reuse_gguf_readers`).

    A state-space or hybrid file (``mamba2``, ``granitehybrid``, ``falcon-h1``) gets its config from
    :func:`tokenmill.model_loader.gguf_hybrid.read_state_space_config`, which transformers' reader lacks;
    for other GGUF files the architecture comes from the model type (:data:`GGUF_ARCHITECTURES`; llama.cpp writes
    Mistral and Mixtral files as ``llama``: transformers recognises Mistral by name, and a ``llama`` file with
    experts becomes a Mixtral config here), and ``head_dim`` is taken from ``attention.key_length`` where
    transformers' reader leaves the config class's default (Qwen3).

    Raises:
        OSError, ValueError: from ``transformers`` when the config cannot be read; ValueError naming the
            supported ones for a GGUF architecture tokenmill does not read.
    """
    from transformers import AutoConfig

    if gguf_file is None:
        return AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    path = os.path.join(directory, gguf_file)
    entry = gguf_cache_dir(path)
    saved = None if entry is None else entry / "config"
    if saved is not None and (saved / "config.json").is_file():
        try:
            config = AutoConfig.from_pretrained(str(saved))
            config._name_or_path = directory  # as a fresh read names it
            return config
        except (OSError, ValueError) as exc:  # a damaged cache entry: read the file again
            logger.warning("ignoring the cached GGUF config in %s (%s)", saved, exc)
            shutil.rmtree(saved, ignore_errors=True)
    start = time.perf_counter()
    with reuse_gguf_readers():
        config = read_state_space_config(path)
        if config is None:
            config = _read_transformers_gguf_config(directory, gguf_file, path)
        if not getattr(config, "architectures", None):
            name = GGUF_ARCHITECTURES.get(config.model_type)
            if name:
                config.architectures = [name]
        logger.info("config read from the metadata of %s in %.1f s", gguf_file, time.perf_counter() - start)
        if saved is not None:
            save_atomically(saved, config.save_pretrained)
        read_gguf_tensors(path)  # saves the tensor table for the engine core
        if gguf_tokenizer:
            _prepare_tokenizer(directory, gguf_file, trust_remote_code)
    return config


def _read_transformers_gguf_config(directory: str, gguf_file: str, path: str) -> Any:
    from transformers import AutoConfig

    import gguf

    from tokenmill.model_loader.gguf_state_space import state_space_architectures
    from tokenmill.model_loader.gguf_weights import gguf_architecture, unsupported_architecture_message

    arch = gguf_architecture(gguf.GGUFReader(path))
    if arch in state_space_architectures():  # transformers may read some (mamba) but tokenmill has no model
        raise ValueError(unsupported_architecture_message(arch))
    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=gguf_file)
    except ValueError as exc:
        if "is not supported" not in str(exc):
            raise
        raise ValueError(unsupported_architecture_message(arch)) from exc
    return _fix_gguf_config(config, path)


def derived_max_model_len(hf_config: Any) -> int | None:
    """The context length (tokens) a transformers config declares: the first positive integer of
    ``max_position_embeddings``, ``n_positions``, ``max_seq_len``, ``seq_length`` (of the config, then of its text
    config); ``None`` when it names none (a state-space model such as Mamba2 has no position limit)."""
    from tokenmill.config import text_config_of

    for cfg in (hf_config, text_config_of(hf_config)):  # a vision-language model declares it in its text_config
        for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _prepare_tokenizer(directory: str, gguf_file: str, trust_remote_code: bool) -> None:
    from tokenmill.tokenizer import load_tokenizer

    try:
        load_tokenizer(directory, gguf_file, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - reported, with advice, where the tokenizer is needed
        logger.debug("the tokenizer of %s was not prepared with its config (%s)", gguf_file, exc)


def _fix_gguf_config(config: Any, path: str) -> Any:
    import gguf

    from tokenmill.model_loader.gguf_weights import gguf_architecture

    reader = gguf.GGUFReader(path)
    arch = gguf_architecture(reader)

    def value(key: str) -> Any:
        field = reader.fields.get(f"{arch}.{key}")
        return None if field is None else field.parts[field.data[0]].tolist()[0]

    key_length = value("attention.key_length")
    if key_length and hasattr(config, "head_dim") and config.head_dim != key_length:
        config.head_dim = int(key_length)
    if hasattr(config, "attention_bias") and any(t.name.endswith(".attn_q.bias") for t in reader.tensors):
        config.attention_bias = True  # not in the metadata: the tensors say it
    if arch == "phi3":
        config = _phi3_rope(config, reader, value)
    if config.model_type == "mistral" and value("attention.sliding_window") is None:
        config.sliding_window = None  # llama.cpp's llama files attend to the whole context
    experts = value("expert_count")
    if config.model_type in ("llama", "mistral") and experts:
        from transformers import MixtralConfig

        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        config = MixtralConfig(**fields, num_local_experts=int(experts),
                               num_experts_per_tok=int(value("expert_used_count") or 2))
    return config


def _phi3_rope(config: Any, reader: Any, value: Any) -> Any:
    """Partial rotary (``rope.dimension_count``) and LongRoPE (the ``rope_factors_long`` / ``_short`` tensors,
    ``rope.scaling.original_context_length``, ``rope.scaling.attn_factor``) of a Phi-3 file, which transformers'
    GGUF reader does not carry over."""
    import gguf

    params = dict(getattr(config, "rope_parameters", None) or {})
    head_dim = config.hidden_size // config.num_attention_heads
    rotary = value("rope.dimension_count")
    if rotary and rotary != head_dim:
        params["partial_rotary_factor"] = rotary / head_dim
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if {"rope_factors_long.weight", "rope_factors_short.weight"} <= set(factors):
        def read(name: str) -> list[float]:
            t = factors[name]
            return [float(x) for x in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)]

        original = int(value("rope.scaling.original_context_length") or config.max_position_embeddings)
        params.update(rope_type="longrope", long_factor=read("rope_factors_long.weight"),
                      short_factor=read("rope_factors_short.weight"), original_max_position_embeddings=original)
        attention = value("rope.scaling.attn_factor")
        if attention:
            params["attention_factor"] = float(attention)
        config.original_max_position_embeddings = original
    config.rope_parameters = params
    return config
