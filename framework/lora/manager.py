"""LoRAModelManager: the worker side of multi-LoRA serving.

It wraps the model's linear layers (:class:`~tokenmill.lora.layers.LinearWithLoRA`), keeps up to
``max_cpu_loras`` adapters packed in host memory (LRU) and ``max_loras`` of them in the layers' device slots
(LRU: a slot is reused for a new adapter only when none of the step's requests uses it), and builds each
step's token -> slot mapping. An adapter that fell out of the host cache is read again from its path.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from tokenmill.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from tokenmill.lora.layers import LinearWithLoRA, LoRASlice, LoRAStepState
from tokenmill.lora.ops import LoRABatchMapping, get_lora_method
from tokenmill.lora.peft import PEFTAdapter, check_rank, load_peft_adapter
from tokenmill.lora.request import LoRALoadError, LoRARequest

logger = logging.getLogger(__name__)

Packed = dict[str, tuple[torch.Tensor, torch.Tensor]]  # LoRA layer name -> (lora_a, lora_b) of one adapter
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _slices_of(name: str, layer: LinearBase, stacked: tuple[tuple[str, str, Any], ...]) -> list[LoRASlice]:
    attr = name.rsplit(".", 1)[-1]
    rows = [(ckpt.strip("."), shard) for param, ckpt, shard in stacked if param.strip(".") == attr]
    if not rows:
        return [LoRASlice(attr, None, layer.out_features * getattr(layer, "tp_size", 1)
                          if not isinstance(layer, RowParallelLinear) else layer.out_features)]
    sizes: list[int]
    if hasattr(layer, "total_num_heads"):  # QKVParallelLinear
        h = layer.head_size  # type: ignore[attr-defined]
        by_shard = {"q": layer.total_num_heads * h, "k": layer.total_num_kv_heads * h,  # type: ignore[attr-defined]
                    "v": layer.total_num_kv_heads * h}  # type: ignore[attr-defined]
        sizes = [by_shard[str(shard)] for _, shard in rows]
    else:  # MergedColumnParallelLinear
        sizes = [layer.output_sizes[int(shard)] for _, shard in rows]  # type: ignore[attr-defined]
    return [LoRASlice(ckpt, shard, size) for (ckpt, shard), size in zip(rows, sizes)]


class LoRAModelManager:
    """Adapters of one worker.

    Args:
        model: the loaded model (its tensor-parallel linear layers are wrapped in place).
        max_loras: device slots.
        max_lora_rank: R.
        max_cpu_loras: adapters kept packed on the host.

    Raises:
        ValueError: the model has no linear layer LoRA can adapt.
    """

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.model = model
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.state = LoRAStepState()
        self.method = get_lora_method()
        self.layers: dict[str, LinearWithLoRA] = {}
        # checkpoint module name -> (LoRA layer name, its sub-projection name or fused name)
        self.targets: dict[str, tuple[str, str]] = {}
        stacked = tuple(getattr(model, "stacked_params_mapping", ()) or ())
        self.remap: dict[str, str] = dict(getattr(model, "checkpoint_name_remap", {}) or {})
        for name, module in list(model.named_modules()):
            if type(module) is LinearBase or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            slices = _slices_of(name, module, stacked)
            fused = name.rsplit(".", 1)[-1]
            wrapped = LinearWithLoRA(module, slices, fused, max_loras, max_lora_rank, self.method, self.state)
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, wrapped)
            self.layers[name] = wrapped
            for s in slices:
                self.targets[f"{parent_name}.{s.name}"] = (name, s.name)
            self.targets[f"{parent_name}.{fused}"] = (name, fused)
        if not self.layers:
            raise ValueError("enable_lora: the model has no tensor-parallel linear layers LoRA can adapt")
        self.supported_names = sorted({t.rsplit(".", 1)[-1] for t in self.targets})
        inner = getattr(model, "model", None)
        self.layer_range = (int(getattr(inner, "start_layer", 0)), int(getattr(inner, "end_layer", 1 << 30)))
        self.num_layers = int(getattr(getattr(model, "config", None), "num_hidden_layers", 1 << 30))
        self.cpu_cache: OrderedDict[int, Packed] = OrderedDict()
        self.slot_ids: list[int | None] = [None] * max_loras  # adapter id held by each slot
        self.slot_lru: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.requests: dict[int, LoRARequest] = {}
        logger.info("LoRA: %d layers adapted (%s), %d slots of rank %d", len(self.layers),
                    ", ".join(self.supported_names), max_loras, max_lora_rank)

    # ------------------------------------------------------------------ loading

    def _pack(self, adapter: PEFTAdapter) -> Packed:
        targets = adapter.target_modules
        if isinstance(targets, list):
            lacking = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(self.supported_names))
            if lacking:
                raise LoRALoadError(
                    f"lora_path: the adapter targets {lacking}, which this model has no LoRA-capable linear layers "
                    f"for (supported: {', '.join(self.supported_names)})")
        per_layer: dict[str, dict[str, Any]] = {}
        for module, weights in adapter.modules.items():
            name = module
            for old, new in self.remap.items():
                name = name.replace(old, new)
            hit = self.targets.get(name)
            if hit is None:
                m = _LAYER_INDEX.search(name)
                if m is not None and int(m[1]) < self.num_layers and not (
                        self.layer_range[0] <= int(m[1]) < self.layer_range[1]):
                    continue  # a layer of another pipeline stage
                raise LoRALoadError(
                    f"lora_path: the adapter has weights for {module!r}, which this model has no LoRA-capable "
                    f"linear layer for (supported target modules: {', '.join(self.supported_names)})")
            layer_name, part = hit
            per_layer.setdefault(layer_name, {})[part] = weights
        check_rank(adapter, self.max_lora_rank)
        return {layer_name: self.layers[layer_name].pack(parts, layer_name) for layer_name, parts in per_layer.items()}

    def add_adapter(self, request: LoRARequest) -> None:
        """Read, check and pack ``request``'s adapter into the host cache (again if already there).

        Raises:
            LoRALoadError: the adapter cannot be used (nothing is kept).
        """
        packed = self._pack(load_peft_adapter(request.lora_path))
        old = self.requests.get(request.lora_int_id)
        if old is not None and old != request:
            self._drop_slot(request.lora_int_id)  # same id, new adapter: the slot's copy is stale
        self.requests[request.lora_int_id] = request
        self.cpu_cache[request.lora_int_id] = packed
        self.cpu_cache.move_to_end(request.lora_int_id)
        while len(self.cpu_cache) > self.max_cpu_loras:
            self.cpu_cache.popitem(last=False)

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter (host cache and slot). Returns whether it was known."""
        known = self.requests.pop(lora_int_id, None) is not None
        self.cpu_cache.pop(lora_int_id, None)
        self._drop_slot(lora_int_id)
        return known

    def list_adapters(self) -> list[int]:
        """Ids of the adapters in the host cache or a slot."""
        return sorted(set(self.cpu_cache) | set(self.slot_lru))

    def _drop_slot(self, lora_int_id: int) -> None:
        slot = self.slot_lru.pop(lora_int_id, None)
        if slot is not None:
            self.slot_ids[slot] = None

    # ------------------------------------------------------------------ steps

    def _slot_for(self, request: LoRARequest, in_step: set[int]) -> int:
        lid = request.lora_int_id
        slot = self.slot_lru.get(lid)
        if slot is not None:
            self.slot_lru.move_to_end(lid)
            return slot
        if lid not in self.cpu_cache or self.requests.get(lid) != request:
            self.add_adapter(request)  # evicted from the host cache (or never loaded here): read it again
        packed = self.cpu_cache[lid]
        self.cpu_cache.move_to_end(lid)
        free = [i for i, held in enumerate(self.slot_ids) if held is None]
        if free:
            slot = free[0]
        else:
            victim = next((v for v in self.slot_lru if v not in in_step), None)
            if victim is None:
                raise RuntimeError(f"a step uses more than max_loras={self.max_loras} adapters")
            slot = self.slot_lru.pop(victim)
        for name, layer in self.layers.items():
            layer.set_slot(slot, packed.get(name))
        self.slot_ids[slot] = lid
        self.slot_lru[lid] = slot
        return slot

    def prepare_step(self, lora_requests: list[LoRARequest | None], num_scheduled: list[int],
                     device: torch.device) -> None:
        """Set the step's mapping: ``lora_requests[i]`` is request ``i``'s adapter (batch order), ``None``
        the base model. Loads adapters into slots as needed.

        Raises:
            RuntimeError: more distinct adapters than slots (the scheduler prevents this).
            LoRALoadError: an adapter that had to be read again can no longer be loaded.
        """
        if not any(r is not None for r in lora_requests):
            self.state.mapping = None
            return
        in_step = {r.lora_int_id for r in lora_requests if r is not None}
        if len(in_step) > self.max_loras:
            raise RuntimeError(f"a step uses {len(in_step)} adapters but there are max_loras={self.max_loras} slots")
        slots = [-1 if r is None else self._slot_for(r, in_step) for r in lora_requests]
        self.state.mapping = LoRABatchMapping.build(slots, num_scheduled, self.max_loras, device)
