"""Logits processors: plugin code that edits the logits of every sampled row before the sampler (vLLM V1's
custom logits processors, in a smaller form).

A processor is a class built once per model runner (so once per worker process) with
``cls(config: EngineConfig, device: torch.device)``; each step it gets the logits of the rows that sample and
what it needs to know about their requests (:class:`LogitsProcessorBatch`), and returns the logits to sample
from. It decides per request from ``SamplingParams.extra_args`` (a free-form dict the user passes, e.g.
``SamplingParams(extra_args={"ban_tokens": [13]})``), so one processor can serve every request and act on the
ones that ask.

Which processors run: every one a plugin registers through the hook
``tokenmill_register_logits_processors(registry)`` (``registry.register_logits_processor(name, cls)``), plus
the ``"module:Class"`` paths given with ``--logits-processors`` / ``LLM(logits_processors=[...])``, in that
order (each plugin's, in plugin load order, then the flag's). A processor that declares
:meth:`LogitsProcessor.is_argmax_invariant` is skipped in steps whose rows are all greedy (vLLM's rule).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tokenmill.plugins.fed_registry import HookFedRegistry, Target


@dataclass(frozen=True)
class LogitsProcessorBatch:
    """The requests of the rows being processed, row ``i`` being request ``i``.

    Attributes:
        req_ids: request ids.
        sampling_params: each request's :class:`tokenmill.SamplingParams` (``extra_args`` carries the
            processor's per-request settings).
        prompt_token_ids: each prompt's token ids.
        output_token_ids: tokens generated so far (before this step's).
    """

    req_ids: Sequence[str]
    sampling_params: Sequence[Any]
    prompt_token_ids: Sequence[Sequence[int]]
    output_token_ids: Sequence[Sequence[int]]


class LogitsProcessor(ABC):
    """Base class of a logits processor.

    Args:
        config: the engine configuration.
        device: the worker's device (where the logits are).
    """

    def __init__(self, config: Any, device: torch.device) -> None:
        self.config = config
        self.device = device

    def is_argmax_invariant(self) -> bool:
        """True when the processor never changes which token has the largest logit (so greedy-only steps may
        skip it). Default: False."""
        return False

    @abstractmethod
    def apply(self, logits: torch.Tensor, batch: LogitsProcessorBatch) -> torch.Tensor:
        """Return the logits to sample from (in place or new).

        Args:
            logits: ``[N, vocab]`` of the rows that sample this step, in the model's dtype or float32.
            batch: the rows' requests.

        Returns:
            ``[N, vocab]`` logits; ``-inf`` bans a token.
        """


class LogitsProcessorRegistry(HookFedRegistry):
    """Name -> processor class, fed by ``tokenmill_register_logits_processors(registry)``."""

    hook_name: ClassVar[str] = "tokenmill_register_logits_processors"
    kind: ClassVar[str] = "logits processor"

    @classmethod
    def register_logits_processor(cls, name: str, processor_cls: Target) -> None:
        """Register ``processor_cls`` (a :class:`LogitsProcessor` subclass or its ``"module:Class"``) as
        ``name``; every engine started afterwards in a process that loads the plugin runs it."""
        cls._register(name, processor_cls)

    @classmethod
    def get_names(cls) -> list[str]:
        return cls._names()

    @classmethod
    def load_all(cls) -> list[tuple[str, type[LogitsProcessor]]]:
        """Every registered processor class, imported now, in registration order of the names.

        Raises:
            ImportError: a registered path cannot be imported.
            TypeError: a registered class is not a :class:`LogitsProcessor`.
        """
        return [(name, _check(name, cls._load(name, cls._lookup(name)))) for name in cls._names()]


def _check(name: str, cls: type) -> type[LogitsProcessor]:
    if not issubclass(cls, LogitsProcessor):
        raise TypeError(f"logits processor {name!r}: {cls.__module__}.{cls.__qualname__} is not a LogitsProcessor "
                        "subclass")
    return cls


def build_logits_processors(config: Any, device: torch.device) -> list[LogitsProcessor]:
    """The processors an engine runs (see the module docstring), built for ``device``.

    Raises:
        ImportError / TypeError: a processor cannot be imported or is not a :class:`LogitsProcessor`.
    """
    from tokenmill.plugins.qualname import resolve_qualname

    classes = [cls for _, cls in LogitsProcessorRegistry.load_all()]
    for entry in getattr(config, "logits_processors", None) or ():
        cls = resolve_qualname(entry) if isinstance(entry, str) else entry
        classes.append(_check(str(entry), cls))
    return [cls(config, device) for cls in classes]


def apply_logits_processors(
    processors: Sequence[LogitsProcessor], logits: torch.Tensor, batch: LogitsProcessorBatch, all_greedy: bool
) -> torch.Tensor:
    """Run ``processors`` in order on ``logits`` ``[N, vocab]``; in an all-greedy step the argmax-invariant ones
    are skipped."""
    for processor in processors:
        if all_greedy and processor.is_argmax_invariant():
            continue
        out = processor.apply(logits, batch)
        if out is None or out.shape != logits.shape:
            raise RuntimeError(f"logits processor {type(processor).__qualname__} returned "
                               f"{None if out is None else tuple(out.shape)}, expected {tuple(logits.shape)}")
        logits = out
    return logits
