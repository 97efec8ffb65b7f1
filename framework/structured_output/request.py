"""StructuredOutputRequest: the constraint of one engine-core request and its matcher (once compiled)."""

from __future__ import annotations

from concurrent.futures import Future

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend_types import StructuredOutputGrammar, clean_library_error


class StructuredOutputRequest:
    """What the scheduler keeps for a constrained request.

    Attributes:
        params: the request's constraint.
        error: why compilation failed (the request is then finished with an error), else ``None``.
    """

    def __init__(self, params: StructuredOutputsParams) -> None:
        self.params = params
        self.error: str | None = None
        self._future: Future[StructuredOutputGrammar] | None = None
        self._grammar: StructuredOutputGrammar | None = None

    def set_future(self, future: Future[StructuredOutputGrammar]) -> None:
        self._future = future

    @property
    def future(self) -> Future[StructuredOutputGrammar] | None:
        """The pending compilation (``None`` once collected)."""
        return self._future

    def check_ready(self) -> bool:
        """Collect a finished compilation; True when the matcher is ready (see :attr:`error` on failure)."""
        if self._grammar is not None:
            return True
        if self._future is None or not self._future.done():
            return False
        future, self._future = self._future, None
        try:
            self._grammar = future.result()
        except Exception as exc:  # noqa: BLE001 - any compile failure fails this request only
            self.error = clean_library_error(exc)
            return False
        return True

    @property
    def grammar(self) -> StructuredOutputGrammar | None:
        """The matcher, or ``None`` while compiling (or after a failure)."""
        return self._grammar

    def cancel(self) -> None:
        """Drop the matcher and cancel a compilation not started yet."""
        if self._future is not None:
            self._future.cancel()
            self._future = None
        self._grammar = None
