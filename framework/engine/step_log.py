"""A per-step timing log of the engine core, for profiling (``TOKENMILL_STEP_LOG=path``).

One line per step that ran tokens: ``start duration_ms tokens requests prefill_requests``, where ``start`` is
``time.monotonic()`` in seconds (comparable between processes of one machine, so a client's marks can cut the
log into runs), ``duration_ms`` the wall time of schedule + execute + update in milliseconds, ``tokens`` the
step's scheduled tokens and ``prefill_requests`` the requests that computed more than one token (a
one-token prompt counts as a decode, a speculative verification as a prefill). Each engine core
process appends to ``path.<pid>``. Where a serving run's time goes (prefill against decode steps, step time
against batch size) is read off this file; nothing is written when the variable is unset.
"""

from __future__ import annotations

import os
import time
from typing import IO

from tokenmill.core.sched_output import SchedulerOutput

ENV = "TOKENMILL_STEP_LOG"


class StepLog:
    """Opened from :data:`ENV` (``None`` when unset: :meth:`record` does nothing).

    Raises:
        OSError: the file cannot be opened for appending.
    """

    def __init__(self) -> None:
        path = os.environ.get(ENV)
        self.file: IO[str] | None = open(f"{path}.{os.getpid()}", "a", buffering=1) if path else None

    def record(self, start: float, scheduler_output: SchedulerOutput) -> None:
        """One line for a step that began at ``start`` (``time.monotonic()``) and has just ended."""
        if self.file is None or scheduler_output.is_empty:
            return
        counts = scheduler_output.num_scheduled_tokens
        prefills = sum(1 for n in counts.values() if n > 1)
        self.file.write(f"{start:.4f} {1000 * (time.monotonic() - start):.2f} "
                        f"{scheduler_output.total_num_scheduled_tokens} {len(counts)} {prefills}\n")
