"""Reading LoRA adapters saved by PEFT (``adapter_config.json`` + ``adapter_model.safetensors``).

Only what does not need the model is checked here (files, format, rank); whether the adapter's modules and
shapes fit the model is checked when it is packed for the model's layers (``tokenmill.lora.manager``).
Scaling follows PEFT (``peft.tuners.lora.LoraLayer.update_layer``): ``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``; ``rank_pattern`` / ``alpha_pattern`` override ``r`` /
``lora_alpha`` for modules whose name ends with a pattern key.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.lora.request import LoRALoadError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


@dataclass
class LoRAModuleWeights:
    """One adapted module.

    Attributes:
        lora_a: ``[r, in_features]`` (PEFT's ``lora_A.weight``), float32.
        lora_b: ``[out_features, r]`` (``lora_B.weight``) times ``scaling``, float32.
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass
class PEFTAdapter:
    """A parsed adapter.

    Attributes:
        path: where it was read from.
        rank: the largest rank of its modules.
        target_modules: ``adapter_config.json``'s ``target_modules`` (list of names, or a regex string).
        modules: checkpoint module name (``model.layers.0.self_attn.q_proj``) -> weights.
    """

    path: str
    rank: int
    target_modules: list[str] | str
    modules: dict[str, LoRAModuleWeights] = field(default_factory=dict)


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def read_adapter_config(path: str) -> dict[str, Any]:
    """``adapter_config.json`` of the adapter directory ``path``.

    Raises:
        LoRALoadError: no such directory or file, not JSON, not a LoRA adapter, or a PEFT option tokenmill
            does not support (DoRA, ``modules_to_save``, ``target_parameters``, trained biases).
    """
    if not path or not os.path.isdir(path):
        raise LoRALoadError(f"lora_path: {path!r} is not a directory (it must hold {CONFIG_FILE} and {WEIGHTS_FILE})")
    cfg_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoRALoadError(f"lora_path: {path!r} has no {CONFIG_FILE} (not a PEFT adapter)") from None
    except (OSError, ValueError) as exc:
        raise LoRALoadError(f"lora_path: {CONFIG_FILE} in {path!r} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRALoadError(f"lora_path: {CONFIG_FILE} in {path!r} is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRALoadError(f"lora_path: {path!r} is a {peft_type} adapter; only LORA adapters are supported")
    if cfg.get("use_dora"):
        raise LoRALoadError(f"lora_path: {path!r} is a DoRA adapter (use_dora); DoRA is not supported")
    if cfg.get("modules_to_save"):
        raise LoRALoadError(f"lora_path: {path!r} has modules_to_save {cfg['modules_to_save']}; adapters that "
                            "replace whole modules are not supported")
    if cfg.get("target_parameters"):
        raise LoRALoadError(f"lora_path: {path!r} adapts parameters {cfg['target_parameters']} directly "
                            "(target_parameters, e.g. fused mixture-of-experts weights); only linear layers "
                            "(target_modules) are supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRALoadError(f"lora_path: {path!r} trains biases (bias={cfg['bias']!r}); only bias='none' is supported")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise LoRALoadError(f"lora_path: {CONFIG_FILE} in {path!r}: {key} must be a positive number, got {value!r}")
    return cfg


def load_peft_adapter(path: str) -> PEFTAdapter:
    """Read and check the adapter in directory ``path`` (its rank is checked by :func:`check_rank`, after
    its modules were matched to the model's).

    Raises:
        LoRALoadError: see :func:`read_adapter_config`; no ``adapter_model.safetensors`` (``.bin`` files are
            not read: they are pickles), a corrupt weights file, tensors that are not LoRA A/B pairs of
            matching rank, or non-finite values.
    """
    cfg = read_adapter_config(path)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        hint = " (adapter_model.bin is not read: save with safe_serialization=True)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise LoRALoadError(f"lora_path: {path!r} has no {WEIGHTS_FILE}{hint}")
    try:
        from safetensors.torch import load_file

        tensors = load_file(weights_path)
    except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ValueError ...
        raise LoRALoadError(f"lora_path: {WEIGHTS_FILE} in {path!r} is corrupt or unreadable: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        m = _KEY.match(name)
        if m is None:
            raise LoRALoadError(f"lora_path: unsupported tensor {key!r} in {WEIGHTS_FILE} (only lora_A / lora_B "
                                "weights of linear layers are supported)")
        pairs.setdefault(m["module"], {})[m["which"]] = tensor
    if not pairs:
        raise LoRALoadError(f"lora_path: {WEIGHTS_FILE} in {path!r} holds no LoRA weights")
    r_default, alpha_default = cfg["r"], cfg["lora_alpha"]
    adapter = PEFTAdapter(path=path, rank=0, target_modules=cfg.get("target_modules") or [])
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRALoadError(f"lora_path: module {module!r} has no {missing} weight in {WEIGHTS_FILE}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRALoadError(f"lora_path: module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                                "are not a [r, in] / [out, r] pair")
        rank = int(a.shape[0])
        a, b = a.float(), b.float()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRALoadError(f"lora_path: module {module!r} has non-finite values (corrupt adapter)")
        r = _pattern_value(cfg.get("rank_pattern") or {}, module, r_default)
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module, alpha_default)
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        adapter.modules[module] = LoRAModuleWeights(a.contiguous(), (b * scaling).contiguous())
        adapter.rank = max(adapter.rank, rank)
    return adapter


def check_rank(adapter: PEFTAdapter, max_lora_rank: int) -> None:
    """Raises LoRALoadError when a module's rank exceeds ``max_lora_rank``."""
    for module, weights in adapter.modules.items():
        if weights.rank > max_lora_rank:
            raise LoRALoadError(f"lora_path: adapter rank {weights.rank} (module {module!r}) exceeds --max-lora-rank "
                                f"{max_lora_rank}; restart the engine with a larger --max-lora-rank")
