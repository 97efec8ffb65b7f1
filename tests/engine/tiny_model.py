"""Helpers for end-to-end tests on the tiny random Llama: a model directory with a tokenizer, and recorders.

``tests/conftest.py``'s ``tiny_llama_dir`` holds weights only; the offline ``LLM`` also needs a tokenizer, so
:func:`tiny_llama_with_tokenizer` copies the weights next to the byte-level test tokenizer (vocab ~400 ids,
all inside the model's 512, ``<eos>`` = 2 like the model's EOS).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from tests.engine.engine_fakes import byte_level_tokenizer
from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.core.scheduler import Scheduler

# 200 token ids inside the tiny model's vocabulary, avoiding BOS (1) and EOS (2).
PREFIX_200 = [(i * 37 + 11) % 500 + 3 for i in range(200)]


def tiny_llama_with_tokenizer(weights_dir: str, dest: Path) -> str:
    """Copy the tiny Llama in ``weights_dir`` to ``dest`` and save the byte-level tokenizer there."""
    shutil.copytree(weights_dir, dest, dirs_exist_ok=True)
    byte_level_tokenizer().save_pretrained(str(dest))
    return str(dest)


class ScheduleRecorder:
    """Wraps ``scheduler.schedule`` and keeps every step's :class:`SchedulerOutput`.

    Attributes:
        steps: the outputs, in order.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.steps: list[SchedulerOutput] = []
        original: Callable[[], SchedulerOutput] = scheduler.schedule

        def schedule() -> SchedulerOutput:
            out = original()
            self.steps.append(out)
            return out

        scheduler.schedule = schedule  # type: ignore[method-assign]

    def scheduled_tokens(self, request_id: str) -> list[int]:
        """Tokens scheduled for ``request_id`` in each step that scheduled it."""
        return [s.num_scheduled_tokens[request_id] for s in self.steps if request_id in s.num_scheduled_tokens]

    def admission_order(self) -> list[str]:
        """Request ids in the order they were first sent to the worker."""
        order: list[str] = []
        for s in self.steps:
            for new in s.scheduled_new_reqs:
                if new.req_id not in order:
                    order.append(new.req_id)
        return order

    def clear(self) -> None:
        self.steps.clear()
