"""What a contract item checks and how it reports: the :class:`ConformanceTarget` it is given, and the
:class:`ContractFailure` / :class:`ItemSkipped` it raises.

The items (``checks_*.py``) import this module, and the runner (:mod:`tokenmill.conformance.kit`) imports the
items, so the items never import the runner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.platforms.interface import Platform
from tokenmill.plugins.manager import LoadedPlatformSpec


class ContractFailure(AssertionError):
    """A contract item failed; the message says what the platform did and what the contract asks."""


class ItemSkipped(Exception):
    """A contract item does not apply (the platform does not claim the feature); the message says why."""


@dataclass
class ConformanceTarget:
    """What the items check, shared by them (an item may cache results here for later ones).

    Attributes:
        platform_cls: the plugin's own Platform class.
        run_cls: the class the items run with (``platform_cls``, or its emulated subclass).
        plugin: where it came from (``None`` for a class given directly).
        emulated: whether the device is emulated.
        device: the torch device tensors go to.
        attention_backend: registered name or ``"module:Class"`` checked instead of the platform's choice.
        notes: filled by the running item.
        cache: shared state between items (the tiny model, engines).
    """

    platform_cls: type[Platform]
    run_cls: type[Platform]
    plugin: LoadedPlatformSpec | None
    emulated: bool
    device: torch.device
    attention_backend: str | None = None
    notes: list[str] = field(default_factory=list)
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.platform_cls.name

    def note(self, text: str) -> None:
        self.notes.append(text)

    def engine_config(self, dtype: str = "auto") -> Any:
        """An EngineConfig without a model (for the platform's config hooks)."""
        from tokenmill.config import EngineConfig, ModelConfig

        model = ModelConfig(model="conformance-kit", tokenizer="conformance-kit", hf_config=None, dtype=dtype)
        return EngineConfig(model_config=model, attention_backend=self.attention_backend)

    def backend_choice(self) -> Any:
        """The attention backend under test (``tokenmill.attention.selector.AttentionBackendChoice``)."""
        if "backend" not in self.cache:
            from tokenmill.attention.selector import select_attn_backend

            self.cache["backend"] = select_attn_backend(self.run_cls, self.engine_config())
        return self.cache["backend"]


CheckFn = Callable[[ConformanceTarget], None]
