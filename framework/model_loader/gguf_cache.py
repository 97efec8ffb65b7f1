"""Disk cache of what is slow to read from a GGUF file: its transformers config and its tensor table.

``gguf.GGUFReader`` and transformers' GGUF loader walk every metadata entry in Python: for the embedded
SmolLM2 file that is about 100,000 vocabulary and merge strings, 5-20 s per reader on a small busy CPU, paid
again by every process that opens the file (the front end for the config, the engine core for the weights).
What they produce is saved once under ``$TOKENMILL_CACHE_DIR/gguf/<key>/`` and read back in milliseconds:

* ``config/``: the transformers config after tokenmill's fix-ups (``config.json``, loaded with ``AutoConfig``);
* ``tensors.json``: the architecture name and, per tensor, its name, GGML type, dimensions and byte offset; the
  tensor data itself is mapped from the GGUF file (``numpy.memmap``), exactly as ``GGUFReader`` maps it.

On a first read, :func:`reuse_gguf_readers` makes the readers that transformers (config, tokenizer) and tokenmill
(config fix-ups, tensor table) each open for the same file one reader: one metadata walk instead of four.

The key is the file's absolute path, size and modification time plus the ``gguf`` and ``transformers``
versions, so a changed file or library never reads a stale entry. Deleting the directory is always safe; a
damaged entry is ignored (and rewritten).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.cache_dir import cache_root

logger = logging.getLogger(__name__)

_TABLE_VERSION = 1


def gguf_cache_key(path: str) -> str | None:
    """A hex key naming ``path``'s current contents and the reader libraries; ``None`` if it cannot be read."""
    import gguf
    import transformers

    path = os.path.abspath(path)
    try:
        st = os.stat(path)
    except OSError:
        return None
    gguf_version = getattr(gguf, "__version__", None) or _dist_version("gguf")
    raw = f"{path}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{gguf_version}"
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def gguf_cache_dir(path: str) -> Path | None:
    """``$TOKENMILL_CACHE_DIR/gguf/<key>`` for ``path`` (not created here); ``None`` if the file is missing."""
    key = gguf_cache_key(path)
    return None if key is None else cache_root() / "gguf" / key


def save_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp_dir)`` and rename ``tmp_dir`` to ``target``; a concurrent writer's result wins.

    Failures to write are logged, never raised: the cache only saves time.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            write(tmp)
            os.replace(tmp, target)
        except OSError:
            if not target.exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # left only when another process saved it first
    except OSError as exc:
        logger.warning("could not write the cache entry %s (%s)", target, exc)


_REUSE_LOCK = threading.Lock()
_REUSE_DEPTH = 0
_READERS: dict[tuple[str, int, int], Any] = {}
_ORIGINAL_READER: Any = None


@contextlib.contextmanager
def reuse_gguf_readers() -> Iterator[None]:
    """Inside the block, ``gguf.GGUFReader(path)`` (read-only) returns one reader per file and process.

    transformers opens its own reader for the config (``AutoConfig``) and another for the tokenizer
    (``AutoTokenizer``), and both walk every metadata entry; its loader takes the class from the ``gguf`` module
    when called, so the module attribute is replaced for the duration of the block (by a subclass whose
    ``__new__`` hands back the shared reader) and restored when the outermost block ends, which also drops
    the readers. Readers are made lazily: a block whose file is never opened costs nothing. Nested and
    concurrent blocks are allowed; a reader for another file, or a writable one, is a new reader as usual.
    """
    import gguf

    global _REUSE_DEPTH, _ORIGINAL_READER
    with _REUSE_LOCK:
        if _REUSE_DEPTH == 0:
            _ORIGINAL_READER = original = gguf.GGUFReader

            class SharedGGUFReader(original):  # type: ignore[misc, valid-type]
                def __new__(cls, path: Any, mode: str = "r") -> Any:
                    key = _reader_key(path) if mode == "r" else None
                    if key is None:
                        return original(path, mode)
                    with _REUSE_LOCK:
                        reader = _READERS.get(key)
                    if reader is None:
                        reader = original(path, mode)  # not an instance of cls: __init__ does not run again
                        with _REUSE_LOCK:
                            reader = _READERS.setdefault(key, reader)
                    return reader

            gguf.GGUFReader = SharedGGUFReader
        _REUSE_DEPTH += 1
    try:
        yield
    finally:
        with _REUSE_LOCK:
            _REUSE_DEPTH -= 1
            if _REUSE_DEPTH == 0:
                gguf.GGUFReader = _ORIGINAL_READER
                _ORIGINAL_READER = None
                _READERS.clear()


def _reader_key(path: Any) -> tuple[str, int, int] | None:
    try:
        name = os.path.abspath(os.fspath(path))
        st = os.stat(name)
    except (OSError, TypeError, ValueError):
        return None
    return name, st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, its data mapped from the file.

    Attributes:
        name: llama.cpp's tensor name (``blk.0.attn_q.weight``).
        tensor_type: the ``gguf.GGMLQuantizationType``.
        data: ``numpy`` view of the file: element dtype for float/int types (shape = dims reversed), ``uint8``
            with the last dimension in bytes for quantized types, as ``GGUFReader`` gives it.
    """

    name: str
    tensor_type: Any
    data: np.ndarray
    span: tuple[int, int] = (0, 0)  # byte offset and length in the file
    memory: Any = None  # the file's ``mmap.mmap``

    def release(self) -> None:
        """Drop the file's mapped pages up to the end of this tensor from the process (``madvise(MADV_DONTNEED)``):
        once converted they only add to the resident size. Everything before it goes too, since a tensor read
        again after its own release (the first rows of a fused weight, converted when the last arrive) maps its
        pages back. The data stays readable (read again from the page cache)."""
        if self.memory is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        end = min(len(self.memory), self.span[0] + self.span[1])
        if end > 0:
            self.memory.madvise(mmap.MADV_DONTNEED, 0, end)


def read_gguf_tensors(path: str) -> tuple[str, list[GGUFTensor]]:
    """``(general.architecture, tensors)`` of the GGUF file ``path``, from the cache when it has them.

    Raises:
        OSError / ValueError: from ``gguf.GGUFReader`` when the file is unreadable or not GGUF.
    """
    entry = gguf_cache_dir(path)
    table = _load_table(entry) if entry is not None else None
    if table is None:
        table = _build_table(path)
        if entry is not None:
            save_atomically(entry / "tensors", lambda d: (d / "tensors.json").write_text(json.dumps(table)))
    return table["architecture"], _map_tensors(path, table["tensors"])


def _load_table(entry: Path) -> dict[str, Any] | None:
    file = entry / "tensors" / "tensors.json"
    if not file.is_file():
        return None
    try:
        table = json.loads(file.read_text())
        if table.get("version") == _TABLE_VERSION:
            return table
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the cached GGUF tensor table %s (%s)", file, exc)
    return None


def _build_table(path: str) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(path)
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    tensors = [
        {"name": t.name, "type": int(t.tensor_type), "dims": [int(d) for d in t.shape], "offset": int(t.data_offset)}
        for t in reader.tensors
    ]
    return {"version": _TABLE_VERSION, "architecture": arch, "tensors": tensors}


_PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


def _map_tensors(path: str, entries: list[dict[str, Any]]) -> list[GGUFTensor]:
    import gguf

    # A plain ndarray over the map: slices of a numpy.memmap run its __array_finalize__ in every numpy
    # call that dequantization makes (about a second per load of the embedded model).
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    memory = np.frombuffer(mapped, dtype=np.uint8)
    tensors = []
    for e in entries:
        ggml_type = gguf.GGMLQuantizationType(e["type"])
        dims = tuple(reversed(e["dims"]))
        n_elements = int(np.prod(e["dims"]))
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elements * type_size // block_size
        raw = memory[e["offset"]: e["offset"] + n_bytes]
        plain = _PLAIN_TYPES.get(ggml_type.name)
        if plain is not None:
            data = raw.view(plain).reshape(dims)
        else:
            data = raw.reshape(gguf.quants.quant_shape_to_byte_shape(dims, ggml_type))
        tensors.append(GGUFTensor(e["name"], ggml_type, data, (e["offset"], n_bytes), mapped))
    return tensors


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"
