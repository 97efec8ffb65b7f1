"""One weight loader for every decoder family, driven by per-model tables.

A model declares how checkpoint names map to its parameters:

* ``stacked_params_mapping``: ``(param_fragment, checkpoint_fragment, shard_id)`` rows, e.g.
  ``(".qkv_proj", ".q_proj", "q")``: a checkpoint tensor whose name contains ``.q_proj`` is the ``"q"`` shard of
  the parameter named with ``.qkv_proj`` instead (the parameter's ``weight_loader(param, tensor, shard_id)``
  places it). A checkpoint that already ships the fused tensor (Phi-3's ``qkv_proj`` / ``gate_up_proj``) matches
  the parameter name directly and its loader splits it.
* ``expert_weight_names``: checkpoint projection name -> FusedMoE shard (``"w1"`` gate, ``"w3"`` up,
  ``"w2"`` down), for per-expert tensors ``...experts.<e>.<proj>.weight``; 3-D tensors of all experts are
  accepted too: transformers' ``...experts.gate_up_proj`` / ``...experts.down_proj`` and the GGUF loader's
  ``...experts.gate_proj`` / ``up_proj`` / ``down_proj``.
* ``checkpoint_name_remap``: substring replacements applied to checkpoint names first (Mixtral's
  ``.block_sparse_moe.`` -> ``.mlp.``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from tokenmill.layers.linear import default_weight_loader

StackedMapping = Sequence[tuple[str, str, "str | int"]]

_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED_EXPERTS_RE = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$"
)
_FUSED_SHARDS = {"gate_up_proj": "w13", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_EXPERT_PARAM = {"w1": "w13_weight", "w3": "w13_weight", "w13": "w13_weight", "w2": "w2_weight"}

DEFAULT_SKIP = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def load_checkpoint_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    stacked_params_mapping: StackedMapping = (),
    expert_weight_names: Mapping[str, str] | None = None,
    checkpoint_name_remap: Mapping[str, str] | None = None,
    skip_substrings: Sequence[str] = DEFAULT_SKIP,
    ignore_names: Sequence[str] = (),
) -> set[str]:
    """Fill ``model``'s parameters from ``(checkpoint_name, tensor)`` pairs; returns the parameter names filled.

    A FusedMoE parameter counts as filled once every expert's shards are loaded (or a 3-D tensor gave all).

    Raises:
        KeyError: a checkpoint tensor matches no parameter (the message names both).
        ValueError: shapes do not match (from the parameters' loaders).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    expert_parts: dict[str, set[tuple[int | None, str]]] = {}
    for name, tensor in weights:
        if any(s in name for s in skip_substrings) or name in ignore_names:
            continue
        for old, new in (checkpoint_name_remap or {}).items():
            name = name.replace(old, new)
        if expert_weight_names is not None and _load_expert(params, name, tensor, expert_weight_names, expert_parts):
            continue
        for param_part, ckpt_part, shard in stacked_params_mapping:
            if ckpt_part not in name:
                continue
            target = name.replace(ckpt_part, param_part)
            param = params.get(target)
            if param is None:
                continue  # e.g. ".up_proj" inside a name that is not a stacked one
            param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
            loaded.add(target)
            break
        else:
            param = params.get(name)
            if param is None:
                raise KeyError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
    for pname, parts in expert_parts.items():
        num_experts = params[pname].shape[0]
        needed = set(params[pname].expert_shards)  # type: ignore[attr-defined]
        whole = {s for e, s in parts if e is None}
        if all(s in whole or all((e, s) in parts for e in range(num_experts)) for s in needed):
            loaded.add(pname)
    return loaded


def _load_expert(
    params: dict[str, nn.Parameter],
    name: str,
    tensor: torch.Tensor,
    names: Mapping[str, str],
    parts: dict[str, set[tuple[int | None, str]]],
) -> bool:
    m = _EXPERT_RE.match(name)
    if m is not None and m.group("proj") in names:
        shard, expert = names[m.group("proj")], int(m.group("expert"))
    else:
        m = _FUSED_EXPERTS_RE.match(name)
        if m is None:
            return False
        shard, expert = _FUSED_SHARDS[m.group("proj")], None
    pname = f"{m.group('prefix')}.{_EXPERT_PARAM[shard]}"
    param = params.get(pname)
    if param is None:
        return False
    if expert is not None and not 0 <= expert < param.shape[0]:
        raise KeyError(f"checkpoint tensor {name!r}: expert {expert} out of range (the layer has {param.shape[0]})")
    param.weight_loader(param, tensor, shard, expert)  # type: ignore[attr-defined]
    for s in ("w1", "w3") if shard == "w13" else (shard,):
        parts.setdefault(pname, set()).add((expert, s))
    return True
