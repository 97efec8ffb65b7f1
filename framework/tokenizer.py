"""Load the tokenizer of a model (Hugging Face directory or GGUF file), once per process.

A GGUF file's tokenizer is rebuilt by transformers from the file's metadata, which takes seconds (tens of
seconds on a small busy CPU: every vocabulary entry and merge is parsed one by one); the result is saved in
Hugging Face layout under ``$TOKENMILL_CACHE_DIR/gguf/<key>/tokenizer/`` (key: the file's path, size and
modification time, and the gguf and transformers versions; :mod:`tokenmill.model_loader.gguf_cache`) and
loaded from there on later starts, in well under a second. Deleting the directory is always safe.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from tokenmill.config import ModelConfig
from tokenmill.model_loader.gguf_cache import save_atomically

logger = logging.getLogger(__name__)

_CACHE: dict[tuple[str, str | None, bool], Any] = {}
_LOCK = threading.Lock()


def _gguf_cache_dir(directory: str, gguf_file: str) -> Path | None:
    """Where the converted tokenizer of this GGUF file is (or will be) saved; ``None`` if the file is missing."""
    from tokenmill.model_loader.gguf_cache import gguf_cache_dir

    entry = gguf_cache_dir(os.path.join(directory, gguf_file))
    return None if entry is None else entry / "tokenizer"


def _load_gguf_tokenizer(directory: str, gguf_file: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    saved = _gguf_cache_dir(directory, gguf_file)
    if saved is not None and (saved / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(saved), trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:  # a damaged cache entry: convert again
            logger.warning("ignoring the cached tokenizer in %s (%s)", saved, exc)
            shutil.rmtree(saved, ignore_errors=True)
    start = time.perf_counter()
    tokenizer = _gguf_tokenizer_class(directory, gguf_file).from_pretrained(
        directory, gguf_file=gguf_file, trust_remote_code=trust_remote_code)
    logger.info("tokenizer converted from %s in %.1f s", gguf_file, time.perf_counter() - start)
    if saved is not None:
        save_atomically(saved, lambda tmp: tokenizer.save_pretrained(str(tmp)))
    return tokenizer


def _gguf_tokenizer_class(directory: str, gguf_file: str) -> Any:
    """``AutoTokenizer``, which reads the file's config to pick a class, for the architectures transformers'
    GGUF reader knows; the generic fast tokenizer (built from the same ``tokenizer.ggml.*`` metadata) for the
    state-space files tokenmill reads itself."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from tokenmill.model_loader.gguf_cache import read_gguf_tensors
    from tokenmill.model_loader.gguf_state_space import GGUF_STATE_SPACE_ARCHITECTURES

    arch, _ = read_gguf_tensors(os.path.join(directory, gguf_file))
    return PreTrainedTokenizerFast if arch in GGUF_STATE_SPACE_ARCHITECTURES else AutoTokenizer


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

        try:
            if gguf_file is not None:
                tokenizer = _load_gguf_tokenizer(directory, gguf_file, trust_remote_code)
            else:
                tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            where = f"{directory}/{gguf_file}" if gguf_file else directory
            raise OSError(
                f"tokenizer: cannot load a tokenizer from {where!r} ({type(exc).__name__}: {exc}); "
                "pass --tokenizer DIR pointing at a directory with tokenizer files"
            ) from exc
        _CACHE[key] = tokenizer
        return tokenizer
