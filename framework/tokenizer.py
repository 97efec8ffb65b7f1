"""Load the tokenizer of a model (Hugging Face directory or GGUF file), once per process.

A GGUF file's tokenizer is rebuilt by transformers from the file's metadata, which takes seconds (tens of
seconds on a small busy CPU: every vocabulary entry and merge is parsed one by one); the result is saved in
Hugging Face layout under ``$TOKENMILL_CACHE_DIR/tokenizers/<key>/`` (key: the file's path, size and
modification time, and the transformers version) and loaded from there on later starts, in well under a
second. Deleting the directory is always safe.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tokenmill.config import ModelConfig

logger = logging.getLogger(__name__)

_CACHE: dict[tuple[str, str | None, bool], Any] = {}
_LOCK = threading.Lock()


def _gguf_cache_dir(directory: str, gguf_file: str) -> Path | None:
    """Where the converted tokenizer of this GGUF file is (or will be) saved; ``None`` if the file is missing."""
    import transformers

    from tokenmill.worker.compile_cache import cache_root

    path = os.path.abspath(os.path.join(directory, gguf_file))
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}".encode()).hexdigest()
    return cache_root() / "tokenizers" / key[:20]


def _load_gguf_tokenizer(directory: str, gguf_file: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    saved = _gguf_cache_dir(directory, gguf_file)
    if saved is not None and (saved / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(saved), trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:  # a damaged cache entry: convert again
            logger.warning("ignoring the cached tokenizer in %s (%s)", saved, exc)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file, trust_remote_code=trust_remote_code)
    logger.info("tokenizer converted from %s in %.1f s", gguf_file, time.perf_counter() - start)
    if saved is not None:
        try:
            saved.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=saved.name + ".", dir=saved.parent))
            tokenizer.save_pretrained(str(tmp))
            try:
                os.replace(tmp, saved)
            except OSError:  # another process saved it first
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as exc:
            logger.warning("could not cache the converted tokenizer in %s (%s)", saved, exc)
    return tokenizer


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
