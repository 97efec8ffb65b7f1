"""Locate a model (directory, GGUF file or default) and read its transformers config."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tokenmill.model_loader.default_model import DEFAULT_SERVED_MODEL_NAME, default_model_path


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


def load_hf_config(directory: str, gguf_file: str | None, *, trust_remote_code: bool = False) -> Any:
    """Read the ``transformers`` config from ``config.json`` or from a GGUF file's metadata."""
    from transformers import AutoConfig

    if gguf_file is not None:
        config = AutoConfig.from_pretrained(directory, gguf_file=gguf_file)
        if not getattr(config, "architectures", None):
            arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
            name = arch.get(config.model_type)
            if name:
                config.architectures = [name]
        return config
    return AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
