"""On-disk cache of compiled forward passes (``torch.compile`` ahead-of-time artifacts), one file per step kind.

A compiled graph depends on the model's architecture (its config, less where and with which transformers version
it was saved), dtype, KV cache dtype, quantization, KV block size, the
source code that was traced (tokenmill, the model's package, the attention backend's package, kernels
included), the torch and Python versions and the CPU capability torch dispatches to; never on the weights
(they are graph inputs). All of that goes into the cache key, so a key's directory holds graphs that any
engine with the same key may load, and a change to any of it compiles afresh.

Location: ``$TOKENMILL_CACHE_DIR/compiled/<key>/`` (default ``~/.cache/tokenmill``, or
``$XDG_CACHE_HOME/tokenmill``); every directory has a ``meta.json`` saying what it was made for. Deleting the
directory is always safe.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from tokenmill.cache_dir import cache_root

_SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".cu", ".hpp")
_source_digests: dict[str, str] = {}


def source_digest(module_names: Iterable[str]) -> str:
    """SHA-256 over the source files (``.py``, C++, CUDA) of the top-level packages (or one-file modules) of
    ``module_names``."""
    digest = hashlib.sha256()
    for top in sorted({name.split(".")[0] for name in module_names}):
        if top not in _source_digests:
            module = sys.modules.get(top)
            h = hashlib.sha256()
            paths = list(getattr(module, "__path__", []) or []) if module is not None else []
            for root in sorted(paths):
                for path in sorted(Path(root).rglob("*")):
                    if path.suffix in _SOURCE_SUFFIXES and "__pycache__" not in path.parts:
                        h.update(str(path.relative_to(root)).encode())
                        h.update(path.read_bytes())
            single = getattr(module, "__file__", None) if module is not None and not paths else None
            if single and Path(single).is_file():  # a one-file module (e.g. a model plugin's)
                h.update(Path(single).name.encode())
                h.update(Path(single).read_bytes())
            _source_digests[top] = h.hexdigest()
        digest.update(f"{top}:{_source_digests[top]}".encode())
    return digest.hexdigest()


class CompileCache:
    """The directory of one cache key.

    Args:
        facts: everything the compiled graphs depend on besides source code (JSON-serializable).
        modules: modules whose packages' sources are traced (their digest joins the key).
    """

    def __init__(self, facts: dict[str, Any], modules: Iterable[str]) -> None:
        self.facts: dict[str, Any] = {
            **facts,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "sources": source_digest(["tokenmill", *modules]),
        }
        blob = json.dumps(self.facts, sort_keys=True, default=str).encode()
        self.key = hashlib.sha256(blob).hexdigest()[:20]
        self.directory = cache_root() / "compiled" / self.key

    @classmethod
    def at(cls, directory: str | Path) -> CompileCache:
        """The cache of an existing key directory (another process chose it)."""
        cache = cls.__new__(cls)
        cache.directory = Path(directory)
        cache.key = cache.directory.name
        cache.facts = {}
        return cache

    def path(self, kind: str) -> Path:
        return self.directory / f"{kind}.bin"

    def has(self, kind: str) -> bool:
        return self.path(kind).is_file()

    def prepare(self) -> None:
        """Create the directory and its ``meta.json``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        meta = self.directory / "meta.json"
        if not meta.exists():
            meta.write_text(json.dumps(self.facts, indent=1, sort_keys=True, default=str) + "\n", encoding="utf-8")
