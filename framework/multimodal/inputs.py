"""The per-image inputs of a request, as msgspec structs that cross the engine-core hop unchanged.

vLLM's names: a request's ``mm_features`` list one :class:`MultiModalFeature` per image, each with its content
hash (``mm_hash``), the prompt positions its embeddings fill (:class:`PlaceholderRange`) and the processor's
tensors for that image (pixel values and whatever else the model's encoder takes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch  # imported where tensors are made: a process that only passes requests on needs no torch

# torch dtype name <-> numpy dtype of the tensors a processor returns (bfloat16 travels as its raw 16 bits).
_NUMPY_DTYPES = {
    "float32": np.float32, "float16": np.float16, "float64": np.float64, "int64": np.int64, "int32": np.int32,
    "bool": np.bool_, "uint8": np.uint8,
}


class TensorData(msgspec.Struct, array_like=True):
    """A tensor on the wire: its bytes in C order, its shape and dtype name.

    Attributes:
        data: the raw little-endian bytes.
        shape: the tensor's shape.
        dtype: a torch dtype name (``"float32"``, ``"int64"``, ``"bfloat16"``, ...).
    """

    data: bytes
    shape: list[int]
    dtype: str

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TensorData:
        """Raises: ValueError for a dtype that has no wire form here."""
        import torch

        t = tensor.detach().to("cpu").contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name == "bfloat16":
            raw = t.view(torch.int16).numpy().tobytes()
        elif name in _NUMPY_DTYPES:
            raw = t.numpy().tobytes()
        else:
            raise ValueError(f"multimodal tensors of dtype {name} cannot be sent to the engine core")
        return cls(raw, list(t.shape), name)

    def to_tensor(self) -> torch.Tensor:
        """The tensor (CPU, a fresh copy)."""
        import torch

        if self.dtype == "bfloat16":
            arr = np.frombuffer(self.data, dtype=np.int16).reshape(self.shape)
            return torch.from_numpy(arr.copy()).view(torch.bfloat16)
        arr = np.frombuffer(self.data, dtype=_NUMPY_DTYPES[self.dtype]).reshape(self.shape)
        return torch.from_numpy(arr.copy())


class PlaceholderRange(msgspec.Struct, array_like=True, frozen=True):
    """The prompt positions ``[offset, offset + length)`` of one image, whose embeddings replace them in order.

    vLLM's ``is_embed``: a model whose processor puts text tokens among an image's embedding tokens (Idefics3's
    ``<fake_token_around_image><row_1_col_2>`` between tiles) marks which positions of the range take an
    embedding row; the others keep their text embeddings. ``None``: every position does.
    """

    offset: int
    length: int
    is_embed: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if self.is_embed is not None and len(self.is_embed) != self.length:
            raise ValueError(f"is_embed has {len(self.is_embed)} entries for a placeholder of {self.length} tokens")

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """Embedding rows the image takes (the encoder's output rows; its encoder-cache and budget cost)."""
        return self.length if self.is_embed is None else sum(self.is_embed)

    def embeds_in(self, start: int, end: int) -> tuple[int, list[int]]:
        """For prompt positions ``[start, end)`` (clipped to the range): the index of the first embedding row
        they take, and the positions that take rows, ascending (one row each, consecutive rows)."""
        lo, hi = max(start, self.offset), min(end, self.end)
        if lo >= hi:
            return 0, []
        if self.is_embed is None:
            return lo - self.offset, list(range(lo, hi))
        first = sum(self.is_embed[: lo - self.offset])
        return first, [p for p in range(lo, hi) if self.is_embed[p - self.offset]]

    def embed_runs(self) -> list[tuple[int, int]]:
        """The maximal runs of consecutive embedding positions as ``(start, end)`` prompt positions (end
        exclusive), ascending: the whole range when ``is_embed`` is ``None`` (vLLM's ``extract_embeds_range``;
        each run is one block of bidirectional attention in a multimodal prefix-LM, Gemma 3)."""
        if self.is_embed is None:
            return [(self.offset, self.end)]
        runs: list[tuple[int, int]] = []
        start = None
        for i, embed in enumerate((*self.is_embed, False)):
            if embed and start is None:
                start = i
            elif not embed and start is not None:
                runs.append((self.offset + start, self.offset + i))
                start = None
        return runs


class MultiModalFeature(msgspec.Struct, array_like=True):
    """One image of a request.

    Attributes:
        modality: ``"image"``.
        mm_hash: hex digest of the processed image (and the processor options that shaped it): equal hashes
            mean equal encoder outputs, so it keys the encoder cache and enters the prefix-cache block hashes.
        placeholder: where in the prompt its embeddings go (``length`` = the encoder's output rows).
        data: the model encoder's inputs for this image by name (e.g. ``pixel_values`` ``[1, 3, H, W]``).
    """

    modality: str
    mm_hash: str
    placeholder: PlaceholderRange
    data: dict[str, TensorData]

    def tensors(self) -> dict[str, torch.Tensor]:
        """``data`` as CPU tensors."""
        return {name: value.to_tensor() for name, value in self.data.items()}
