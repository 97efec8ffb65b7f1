"""Load the tokenizer of a model (Hugging Face directory or GGUF file), once per process."""

from __future__ import annotations

import threading
from typing import Any

from tokenmill.config import ModelConfig

_CACHE: dict[tuple[str, str | None, bool], Any] = {}
_LOCK = threading.Lock()


def get_tokenizer(model_config: ModelConfig) -> Any:
    """The ``transformers`` tokenizer of ``model_config`` (cached per process).

    It loads from ``model_config.tokenizer`` (a directory), reading the vocabulary from the GGUF file
    ``model_config.gguf_file`` inside it when that is set.

    Raises:
        OSError: the directory holds no tokenizer files (the message names the directory).
    """
    return load_tokenizer(
        model_config.tokenizer, model_config.gguf_file, trust_remote_code=model_config.trust_remote_code
    )


def load_tokenizer(directory: str, gguf_file: str | None = None, *, trust_remote_code: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained`` for ``directory`` (and ``gguf_file``), cached per process.

    Raises:
        OSError: no tokenizer could be loaded from there.
    """
    key = (directory, gguf_file, trust_remote_code)
    with _LOCK:
        cached = _CACHE.get(key)
        if cached is not None:
            return cached
        from transformers import AutoTokenizer

        kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
        if gguf_file is not None:
            kwargs["gguf_file"] = gguf_file
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
        except (OSError, ValueError) as exc:
            where = f"{directory}/{gguf_file}" if gguf_file else directory
            raise OSError(
                f"tokenizer: cannot load a tokenizer from {where!r} ({type(exc).__name__}: {exc}); "
                "pass --tokenizer DIR pointing at a directory with tokenizer files"
            ) from exc
        _CACHE[key] = tokenizer
        return tokenizer
