"""Where tokenmill keeps what it saves between runs (compiled forward passes, GGUF tables, tokenizers)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$TOKENMILL_CACHE_DIR``, else ``$XDG_CACHE_HOME/tokenmill``, else ``~/.cache/tokenmill`` (not created
    here)."""
    explicit = os.environ.get("TOKENMILL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "tokenmill" if xdg else Path.home() / ".cache" / "tokenmill"
