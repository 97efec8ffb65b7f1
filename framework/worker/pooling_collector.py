"""PoolingCollector: gathers a pooling request's hidden states over the steps of its (chunked) prefill.

A long prompt may run over several steps; each step's rows that the pooler reads (every row for MEAN and ALL,
the last prompt row for LAST, the first for CLS) are copied out of the step's hidden states, and when the last
chunk has run, the pooler turns them into the request's output. The result is the same as pooling one step
that holds the whole prompt: with causal attention a position's hidden state does not depend on how the
prompt was chunked.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from tokenmill.engine.messages import PooledData
from tokenmill.layers.pooler import Pooler
from tokenmill.worker.input_batch import CachedRequestState


class PoolingCollector:
    """Per-request hidden-state rows of pooling requests in flight on this worker.

    Args:
        pooler: the model's pooler.
    """

    def __init__(self, pooler: Pooler) -> None:
        self.pooler = pooler
        self._rows: dict[str, list[torch.Tensor]] = {}

    def discard(self, req_ids: Iterable[str]) -> None:
        """Forget requests (finished, aborted, preempted: a preempted request starts its prompt again)."""
        for req_id in req_ids:
            self._rows.pop(req_id, None)

    def collect(
        self,
        states: Sequence[CachedRequestState],
        counts: Sequence[int],
        query_start_loc: Sequence[int],
        hidden: torch.Tensor,
    ) -> list[PooledData | None] | None:
        """Keep this step's rows of each pooling request; pool those whose prompt is now complete.

        Args:
            states: the step's requests (``num_computed_tokens`` not yet advanced past this step).
            counts: tokens scheduled per request.
            query_start_loc: ``[B + 1]`` offsets of each request's tokens in the flattened batch.
            hidden: ``[T, hidden]`` the model's final hidden states of the step.

        Returns:
            per request the pooled output of a pooling request finished this step, else ``None``; ``None``
            (not a list) when no request of the step is a pooling request.
        """
        finished: list[int] = []
        for i, (state, n) in enumerate(zip(states, counts)):
            if state.pooling_params is None:
                continue
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            rows = self.pooler.select_rows(start, end, state.num_prompt_tokens)
            if rows is not None:
                base = query_start_loc[i]
                # a copy: the step's hidden states may live in a buffer the next step overwrites
                chunk = hidden[base + rows.start : base + rows.stop].to(torch.float32, copy=True)
                self._rows.setdefault(state.req_id, []).append(chunk)
            if end >= state.num_prompt_tokens:
                finished.append(i)
        if not finished and not any(s.pooling_params is not None for s in states):
            return None
        result: list[PooledData | None] = [None] * len(states)
        if finished:
            gathered = [torch.cat(self._rows.pop(states[i].req_id)) for i in finished]
            params = [states[i].pooling_params for i in finished]
            pooled = self.pooler(gathered, params)  # type: ignore[arg-type]
            for i, tensor in zip(finished, pooled):
                t = tensor.detach().to("cpu", torch.float32).contiguous()
                result[i] = PooledData(data=t.numpy().tobytes(), shape=list(t.shape))
        return result
