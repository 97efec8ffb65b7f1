"""Load a GGUF file's (or an AWQ/GPTQ checkpoint's) weights straight into quantized layers: no float copy of the
model ever exists.

With ``--quantization int8|int4`` and a GGUF file, :func:`prepare_quantized_loading` turns every quantizable
layer's weight into a meta-device parameter (no memory) and gives the layer a :class:`QuantizedRowLoader`. The
loader then reads the file tensor by tensor (``tokenmill.model_loader.gguf_weights``, each tensor's mapped
pages released once it is converted); the layers' weight loaders hand their rows, still in GGUF blocks
(:class:`~tokenmill.model_loader.gguf_tensor.GGUFQuantTensor`), to the layer's row loader, and once all of a
layer's rows are in (q, k and v of a fused projection arrive one by one) it builds the layer's only weight:

1. the blocks themselves, when every row has the same GGML type and one of the platform's formats holds that
   type (:meth:`QuantizedWeight.from_gguf`; the CPU plugin: ``Q8_0``/``Q5_0`` in its int8 layout and
   ``Q4_0``/``Q4_1``/``Q4_K`` in its int4 layout exactly), whichever method was asked for: a file is never
   stored with fewer bits than it has, nor with more than it needs;
2. otherwise the rows dequantized and quantized again (:data:`TILE_ROWS` rows at a time in float32, so no
   float copy of a whole weight is made either), in a format chosen by the source: 4 bits or fewer
   (``Q2_K``, ``Q3_K``) -> the ``int4`` format, more (``Q5_1``, ``Q5_K``, ``Q6_K``) -> ``int8``, float
   tensors -> the method asked for (the LM head: the method's ``lm_head_method``).

AWQ, GPTQ and compressed-tensors checkpoints (``tokenmill.model_loader.hf_quant_weights``, ``scaled_quant_weights``)
come the same way, as :class:`~tokenmill.model_loader.group_quant_tensor.GroupQuantTensor` rows: a layer takes the first platform format
that holds them exactly (:meth:`QuantizedWeight.from_zero_point`, ``int4`` before ``int8``), else stays float with
a log line; they are never quantized again.

The layer then runs its quantized weight for every number of rows (``quant_only``). The token embedding keeps
its GGUF blocks and dequantizes the rows it looks up; a tied LM head is built from the same blocks. Peak memory
during the load is the quantized model plus one tile in float32 plus one tensor's mapped pages
(``tests/models/test_quantized_loading.py`` measures it). Tensor and pipeline parallelism keep the float load
and its quantized copies (``tokenmill.model_loader.loader``): a row-parallel shard cuts GGUF blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.layers.quantization import (
    PermutedInput,
    QuantizedWeight,
    UnsupportedShapeError,
    get_quantized_weight_cls,
)
from tokenmill.model_loader.gguf_tensor import GGUFQuantTensor
from tokenmill.model_loader.group_quant_tensor import GroupQuantTensor

logger = logging.getLogger(__name__)

TILE_ROWS = 256  # output rows quantized at a time: a float32 tile of 256 x K, not a whole weight
LOW_BIT_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K"})


class QuantizedRowLoader:
    """Collects one layer's weight rows and quantizes the layer once they are all in.

    Args:
        layer: a linear layer or LM head (``weight`` ``[N, K]``, ``quant``, ``quant_only``).
        cls: the format for float rows (the method asked for, or its ``lm_head_method`` for the head); ``None``:
            float rows stay float (a pre-quantized Hugging Face checkpoint loaded without ``--quantization``).
        formats: every format the platform offers, by method name (``int4``, ``int8``).
        name: the layer's name in the model (log lines).
    """

    def __init__(self, layer: nn.Module, cls: type[QuantizedWeight] | None,
                 formats: dict[str, type[QuantizedWeight]], name: str = ""):
        self.layer = layer
        self.name = name
        self.cls = cls
        self.formats = formats
        self.rows: list[tuple[int, Any]] = []
        self.filled = 0
        self.shape = tuple(layer.weight.shape)
        self.device = layer.weight.device  # where the layer was built: rows arrive on the CPU (the file's pages)
        self.done = False
        self.tied = False  # an LM head whose weight is the token embedding's (fed by feeding_tied_heads)

    def add_rows(self, offset: int, rows: Any) -> None:
        """Rows ``offset:offset + len(rows)`` (float ``[r, K]`` or :class:`GGUFQuantTensor`); the last one builds
        the layer's weight.

        Raises:
            ValueError: the layer was already complete (a checkpoint tensor loaded twice).
        """
        if self.done:
            raise ValueError(f"weight {self.shape}: rows {offset}:{offset + rows.shape[0]} loaded twice")
        self.rows.append((offset, rows))
        self.filled += rows.shape[0]
        if self.filled >= self.shape[0]:
            self._finish()

    def _finish(self) -> None:
        self.done = True
        threads = torch.get_num_threads()
        # Tiles are small and the conversions memory-bound: one thread is as fast on an idle machine, and on
        # a busy one (more runnable threads than cores) parallel regions were 5-20x slower (a 8192 x 2048 Q4_0
        # weight: 0.47 s on 2 threads, 0.05 s on one, 2 cores at load 7)
        torch.set_num_threads(1)
        try:
            self._convert()
        finally:
            torch.set_num_threads(threads)

    def _convert(self) -> None:
        self.rows.sort(key=lambda r: r[0])
        if all(isinstance(r, GroupQuantTensor) for _, r in self.rows):
            self._convert_groups()
            return
        types = {r.type_name if isinstance(r, GGUFQuantTensor) else "float" for _, r in self.rows}
        quant = None
        if len(types) == 1 and "float" not in types:
            (type_name,) = types
            quant = self._tiled(lambda cls, start, end: cls.from_gguf(type_name, self._blocks(start, end)),
                                dict.fromkeys(c for c in (self.cls, *self.formats.values()) if c))
        target = self._target(types)
        if quant is None and target is not None:
            quant = self._tiled(lambda cls, start, end: cls(self._floats(start, end)), [target])
        self._install(quant)

    def _convert_groups(self) -> None:
        """AWQ/GPTQ rows: the first platform format (fewest bits first) that holds them exactly, else float.

        An activation order (GPTQ ``desc_act``) that interleaves groups is undone by sorting the input channels by
        group, when every part of the layer has the same order (q, k and v, or gate and up, see the same inputs):
        the layer then multiplies ``x[..., perm]`` (:class:`PermutedInput`)."""
        pieces = [r for _, r in self.rows]
        perm = None
        if GroupQuantTensor.cat(pieces) is None:
            orders = [p.input_order() for p in pieces]
            if all(o is not None and torch.equal(o, orders[0]) for o in orders):
                perm = orders[0]

        def make(cls: type[QuantizedWeight], start: int, end: int) -> QuantizedWeight | None:
            parts = self._pieces(start, end)
            rows = GroupQuantTensor.cat(parts if perm is None else [p.permuted(perm) for p in parts])
            return None if rows is None else cls.from_zero_point(rows.codes, rows.scales, rows.zeros, rows.bits)

        order = [self.formats[m] for m in ("int4", "int8") if m in self.formats]
        order += [c for c in self.formats.values() if c not in order]
        quant = self._tiled(make, order)
        if quant is not None and perm is not None:
            quant = PermutedInput(quant, perm)
        if quant is None:
            first = self.rows[0][1]
            reason = ("activation order (g_idx) puts neighbouring input channels in different groups, in a different "
                      "order for each part of the layer" if GroupQuantTensor.cat(pieces) is None and perm is None
                      else "no format of this platform holds its codes, scales and zero points exactly")
            logger.info("%s: %d-bit group-quantized weight %s dequantized to float: %s", self.name or "layer",
                        first.bits, list(self.shape), reason)
        else:
            logger.debug("%s: group-quantized weight held as %s", self.name or "layer", type(quant).__qualname__)
        self._install(quant)

    def _install(self, quant: QuantizedWeight | None) -> None:
        if quant is None:  # no format holds it or can pack this shape: the layer keeps a float weight
            self.layer.weight = _param_like(self.layer.weight, self._floats(0, self.shape[0]).to(self.device))
        else:
            self.layer.quant = quant.to(self.device)
            self.layer.quant_only = True
            self.layer.quant_max_tokens = 0
        self.rows = []

    def _tiled(self, make: Any, classes: Any) -> QuantizedWeight | None:
        """The first of ``classes`` for which ``make(cls, start, end)`` gives a weight for rows ``start:end``,
        built :data:`TILE_ROWS` rows at a time when the class joins tiles (``concat_rows``), else in one piece;
        ``None`` when none can (``make`` returns ``None`` or the shape is unsupported)."""
        n = self.shape[0]
        for cls in classes:
            try:
                first = make(cls, 0, min(n, TILE_ROWS))
                if first is None:
                    continue
                if n <= TILE_ROWS:
                    return first
                rest = [make(cls, s, min(n, s + TILE_ROWS)) for s in range(TILE_ROWS, n, TILE_ROWS)]
                joined = cls.concat_rows([first, *rest]) if all(r is not None for r in rest) else None
                if joined is not None:
                    return joined
                del first, rest
                whole = make(cls, 0, n)
            except UnsupportedShapeError:
                continue
            if whole is not None:
                return whole
        return None

    def _pieces(self, start: int, end: int) -> list[Any]:
        """The loaded rows ``start:end``, as slices of the pieces that hold them (in order)."""
        out = []
        for offset, rows in self.rows:
            lo, hi = max(start, offset), min(end, offset + rows.shape[0])
            if lo < hi:
                out.append(rows.narrow(0, lo - offset, hi - lo))
        return out

    def _blocks(self, start: int, end: int) -> torch.Tensor:
        parts = [p.blocks for p in self._pieces(start, end)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _floats(self, start: int, end: int) -> torch.Tensor:
        parts = [p.float() if isinstance(p, torch.Tensor) else p.dequantize() for p in self._pieces(start, end)]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)

    def _target(self, types: set[str]) -> type[QuantizedWeight] | None:
        if "float" in types:
            return self.cls
        if types <= LOW_BIT_TYPES and "int4" in self.formats:
            return self.formats["int4"]
        return self.formats.get("int8", self.cls)


def _param_like(old: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    new = nn.Parameter(data.to(old.dtype), requires_grad=False)
    loader = getattr(old, "weight_loader", None)
    if loader is not None:
        new.weight_loader = loader  # type: ignore[attr-defined]
    return new


def prepare_quantized_loading(model: nn.Module, method: str | None, embedding_blocks: bool = True) -> int:
    """Make ``model``'s quantizable layers (those ``quantize_model`` would quantize) and its token embedding
    take GGUF blocks while loading (module docstring), or AWQ/GPTQ rows
    (:class:`~tokenmill.model_loader.group_quant_tensor.GroupQuantTensor`). Tied weights stay tied (one meta
    parameter).

    Args:
        method: the format for float weights; ``None`` keeps them float (and leaves the LM head alone).
        embedding_blocks: the token embedding keeps GGUF blocks (a GGUF file on the CPU; on a GPU the table is
            dequantized into its float weight as it loads).

    Returns:
        the number of layers prepared.

    Raises:
        ValueError: unknown method or not supported on this platform (``get_quantized_weight_cls``).
    """
    from tokenmill.config import QUANTIZATION_METHODS
    from tokenmill.layers.vocab_embedding import VocabParallelEmbedding

    cls = get_quantized_weight_cls(method) if method else None
    head_cls = get_quantized_weight_cls(cls.lm_head_method) if cls and cls.lm_head_method else cls
    formats = {}
    for m in QUANTIZATION_METHODS:
        try:
            formats[m] = get_quantized_weight_cls(m)
        except ValueError:
            continue
    replaced: dict[int, nn.Parameter] = {}
    embeddings = [m.weight for m in model.modules()  # before any is replaced: a tied LM head shares its parameter
                  if isinstance(m, VocabParallelEmbedding) and not getattr(m, "is_lm_head", False)]

    def to_meta(module: nn.Module) -> None:
        old = module.weight
        new = replaced.get(id(old))
        if new is None:
            new = _param_like(old, torch.empty(old.shape, dtype=old.dtype, device="meta"))
            replaced[id(old)] = new
        module.weight = new

    count = 0
    for name, module in model.named_modules():
        head = getattr(module, "is_lm_head", False)
        if isinstance(module, VocabParallelEmbedding) and not head:
            if module.tp_size == 1 and embedding_blocks:
                module.keep_blocks = True
                to_meta(module)
            continue
        if not hasattr(module, "attach_quantized") or not getattr(module, "quantizable", True):
            continue
        if getattr(module, "tp_size", 1) != 1 or (head and head_cls is None):
            continue
        module.quant_loader = QuantizedRowLoader(module, head_cls if head else cls, formats, name)
        module.quant_loader.tied = head and any(module.weight is w for w in embeddings)
        to_meta(module)
        count += 1
    return count


def feeding_tied_heads(model: nn.Module, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``weights`` unchanged; once the token embedding has been loaded from them, it is also given to a tied
    LM head's row loader (its weight is the embedding's parameter, which the checkpoint fills once)."""
    for name, tensor in weights:
        yield name, tensor
        if not name.endswith("embed_tokens.weight"):
            continue
        for module in model.modules():
            loader = getattr(module, "quant_loader", None)
            if loader is not None and loader.tied and not loader.done:
                loader.add_rows(0, tensor)


def finish_quantized_loading(model: nn.Module) -> None:
    """Check every prepared layer got all its rows and drop the row loaders.

    Raises:
        ValueError: a layer's weight is incomplete (the checkpoint lacks rows of it).
    """
    incomplete = []
    for name, module in model.named_modules():
        loader = getattr(module, "quant_loader", None)
        if loader is None:
            continue
        if not loader.done:
            incomplete.append(f"{name} ({loader.filled} of {loader.shape[0]} rows)")
        module.quant_loader = None
    if incomplete:
        raise ValueError(f"model: checkpoint has no weights for {', '.join(incomplete[:8])}")
