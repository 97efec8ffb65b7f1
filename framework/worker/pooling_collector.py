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

    A MEAN request keeps a running float32 sum of its rows and their count instead of the rows (its pooler gets
    the mean as a single row, whose mean is itself); the others keep the rows :meth:`Pooler.select_rows` names.
    A step's rows of all its pooling requests are read from the hidden states in one gather.

    Args:
        pooler: the model's pooler.
    """

    def __init__(self, pooler: Pooler) -> None:
        self.pooler = pooler
        self._rows: dict[str, list[torch.Tensor]] = {}
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}

    def discard(self, req_ids: Iterable[str]) -> None:
        """Forget requests (finished, aborted, preempted: a preempted request starts its prompt again)."""
        for req_id in req_ids:
            self._rows.pop(req_id, None)
            self._sums.pop(req_id, None)

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
        if not any(s.pooling_params is not None for s in states):
            return None
        finished: list[int] = []
        kept: list[tuple[str, int, int]] = []  # (request id, first row in the step, row count)
        for i, (state, n) in enumerate(zip(states, counts)):
            if state.pooling_params is None:
                continue
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            rows = self.pooler.select_rows(start, end, state.num_prompt_tokens)
            if rows is not None and rows.stop > rows.start:
                kept.append((state.req_id, int(query_start_loc[i]) + rows.start, rows.stop - rows.start))
            if end >= state.num_prompt_tokens:
                finished.append(i)
        if kept:
            self._keep(kept, hidden)
        result: list[PooledData | None] = [None] * len(states)
        if finished:
            gathered = [self._take(states[i].req_id) for i in finished]
            params = [states[i].pooling_params for i in finished]
            pooled = self.pooler(gathered, params)  # type: ignore[arg-type]
            for i, tensor in zip(finished, pooled):
                t = tensor.detach().to("cpu", torch.float32).contiguous()
                result[i] = PooledData(data=t.numpy().tobytes(), shape=list(t.shape))
        return result

    def _keep(self, kept: Sequence[tuple[str, int, int]], hidden: torch.Tensor) -> None:
        """Copy the step's rows of ``kept`` out of ``hidden`` (float32; the step's hidden states may live in a
        buffer the next step overwrites): one gather, and for MEAN one product for the segment sums."""
        index = torch.cat([torch.arange(first, first + n) for _, first, n in kept]).to(hidden.device)
        rows = hidden.index_select(0, index).float()
        if self.pooler.pooling_type == "MEAN":
            segment = torch.repeat_interleave(torch.arange(len(kept)), torch.tensor([n for _, _, n in kept]))
            # [requests, rows] 0/1 @ [rows, hidden]: all segment sums in one product (index_add_ runs on
            # one thread and took longer than the step's pooling otherwise)
            member = torch.zeros(len(kept), rows.shape[0], dtype=torch.float32)
            member[segment, torch.arange(rows.shape[0])] = 1.0
            sums = member.to(rows.device) @ rows
            for (req_id, _, n), row_sum in zip(kept, sums):
                if req_id in self._sums:
                    total, count = self._sums[req_id]
                    self._sums[req_id] = (total + row_sum, count + n)
                else:
                    self._sums[req_id] = (row_sum, n)
            return
        for (req_id, _, _), chunk in zip(kept, rows.split([n for _, _, n in kept])):
            self._rows.setdefault(req_id, []).append(chunk)

    def _take(self, req_id: str) -> torch.Tensor:
        """A finished request's kept rows (``[n, hidden]``; MEAN: its mean, ``[1, hidden]``)."""
        if self.pooler.pooling_type == "MEAN":
            total, count = self._sums.pop(req_id)
            return (total / count)[None]
        chunks = self._rows.pop(req_id)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
