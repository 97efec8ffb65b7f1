"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (detokenization, stop strings, n > 1, metrics).

Per user request it keeps one state with one sequence per engine-core request (``n`` children when
``n > 1``). Each step's outputs are applied to the sequences; then every request that changed gets one
RequestOutput shaped by its ``output_kind``. Requests that have a :class:`RequestOutputCollector` (the
asyncio front end) receive it there; the others' outputs are returned (the sync ``LLMEngine``).

Stop strings: text is matched as it is detokenized; a match ends the sequence, the text is cut before the
stop string (after it with ``include_stop_str_in_output``), ``finish_reason`` is ``"stop"`` and
``stop_reason`` the string, and the engine-core id is returned in ``reqs_to_abort`` so the caller frees it
in the engine core. Text that could still be the beginning of a stop string is never released.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenmill.engine.detokenizer import IncrementalDetokenizer, TokenizerView
from tokenmill.engine.input_processor import ProcessedRequest
from tokenmill.engine.messages import EngineCoreOutput, FinishReason, PooledData
from tokenmill.errors import EngineGenerateError, InvalidRequestError
from tokenmill.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.tool_parsers.abstract_tool_parser import held_back

ERROR_FINISH_REASON = "error"


@dataclass
class OutputProcessorResult:
    """What one call of :meth:`OutputProcessor.process_outputs` produced.

    Attributes:
        request_outputs: outputs of requests without a collector, in order of first appearance.
        reqs_to_abort: engine-core request ids the caller must abort in the engine core (stop strings
            matched, siblings of a failed sequence).
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)


class RequestOutputCollector:
    """Hands one request's outputs from the output handler to its consumer (both on one event loop).

    It holds at most one pending item: a newer CUMULATIVE output replaces the pending one, DELTA outputs are
    merged into it, so a slow consumer never builds a backlog. An exception put here is raised by
    :meth:`get` and wins over any pending output.
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self._kind = output_kind
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        pending = self._item
        if isinstance(pending, BaseException):
            return
        if pending is None or isinstance(item, BaseException) or self._kind != RequestOutputKind.DELTA:
            self._item = item
        else:
            _merge_delta(pending, item)
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output; raises the exception that was put instead, if any."""
        while self._item is None:
            await self._ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        """The pending output or ``None``; raises a pending exception."""
        return None if self._item is None else self._take()

    def _take(self) -> RequestOutput:
        item, self._item = self._item, None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        return item


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            by_index[c.index] = c
            continue
        old.text += c.text
        old.token_ids.extend(c.token_ids)
        if c.logprobs:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason = c.finish_reason
        old.stop_reason = c.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    into.metrics = new.metrics
    if new.prompt_logprobs is not None:
        into.prompt_logprobs = new.prompt_logprobs


class _Sequence:
    """One engine-core request: its tokens, text and stop-string state."""

    def __init__(
        self,
        engine_id: str,
        index: int,
        params: SamplingParams,
        parent: _Request,
        view: TokenizerView,
        prompt_token_ids: list[int],
    ) -> None:
        self.engine_id = engine_id
        self.index = index
        self.params = params
        self.parent = parent
        self.detok = (
            IncrementalDetokenizer(
                view,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
            if params.detokenize
            else None
        )
        self.text = ""
        self.released = 0  # text[:released] may be shown
        self.sent_text = 0  # DELTA: text[:sent_text] was shown
        self.token_ids: list[int] = []
        self.sent_tokens = 0
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.updated = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        if kind == RequestOutputKind.DELTA:
            text = self.text[self.sent_text : self.released]
            token_ids = self.token_ids[self.sent_tokens :]
            logprobs = None if self.logprobs is None else self.logprobs[self.sent_tokens :]
            self.sent_text, self.sent_tokens = self.released, len(self.token_ids)
        else:
            text = self.text[: self.released]
            token_ids = list(self.token_ids)
            logprobs = None if self.logprobs is None else list(self.logprobs)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class _Request:
    """One user request (``n`` sequences) and where its outputs go."""

    def __init__(self, processed: ProcessedRequest, queue: RequestOutputCollector | None) -> None:
        self.request_id = processed.request_id
        self.prompt = processed.prompt
        self.prompt_token_ids = processed.prompt_token_ids
        self.output_kind = processed.params.output_kind
        self.queue = queue
        self.metrics = RequestMetrics(arrival_time=processed.arrival_time)
        self.num_cached_tokens = 0
        self.sequences: list[_Sequence] = []
        self.errored = False
        self.prompt_logprobs: PromptLogprobs | None = None
        self.prompt_logprobs_sent = False
        self.pooling_params = processed.pooling_params
        self.pooled: PooledData | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def build_output(self) -> RequestOutput | None:
        """This step's RequestOutput (a PoolingRequestOutput for a pooling request with its result), or ``None``
        when the output kind has nothing to show yet."""
        finished = self.finished
        if self.pooling_params is not None:
            if self.pooled is not None:
                return self._pooling_output()
            if not finished:
                return None
            # failed or aborted: a RequestOutput that carries the finish reason
        kind = self.output_kind
        if kind == RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            outputs = [s.completion(RequestOutputKind.CUMULATIVE) for s in self.sequences]
        elif kind == RequestOutputKind.DELTA:
            outputs = [s.completion(kind) for s in self.sequences if s.updated]
        else:
            outputs = [s.completion(kind) for s in self.sequences]
        prompt_logprobs = self.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            if self.prompt_logprobs_sent:
                prompt_logprobs = None
            self.prompt_logprobs_sent = prompt_logprobs is not None or self.prompt_logprobs_sent
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            prompt_logprobs=prompt_logprobs,
        )


    def _pooling_output(self) -> PoolingRequestOutput:
        assert self.pooled is not None
        import torch  # the front end (this module's user) imports torch only once a pooling result arrives

        values = np.frombuffer(self.pooled.data, dtype=np.float32).reshape(self.pooled.shape)
        return PoolingRequestOutput(
            request_id=self.request_id,
            outputs=PoolingOutput(torch.from_numpy(values.copy())),
            prompt_token_ids=self.prompt_token_ids,
            finished=True,
            prompt=self.prompt,
        )


class OutputProcessor:
    """Front-end state of every request in flight.

    Args:
        tokenizer: the ``transformers`` tokenizer used for detokenization.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._view = TokenizerView(tokenizer)
        self._requests: dict[str, _Request] = {}
        self._sequences: dict[str, _Sequence] = {}

    def add_request(self, processed: ProcessedRequest, queue: RequestOutputCollector | None = None) -> None:
        """Start tracking a request (before its engine-core requests are sent).

        Raises:
            InvalidRequestError: the request id (or a child id) is already in flight.
        """
        ids = [r.request_id for r in processed.engine_requests]
        if processed.request_id in self._requests or any(i in self._sequences for i in ids):
            raise InvalidRequestError(
                f"request_id: {processed.request_id!r} is already in flight", param="request_id"
            )
        request = _Request(processed, queue)
        for index, engine_request in enumerate(processed.engine_requests):
            seq = _Sequence(
                engine_request.request_id,
                index,
                engine_request.sampling_params,
                request,
                self._view,
                processed.prompt_token_ids,
            )
            request.sequences.append(seq)
            self._sequences[seq.engine_id] = seq
        self._requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Stop tracking requests; returns the engine-core ids to abort in the engine core.

        A request with a collector gets a last output with ``finish_reason="abort"`` on its unfinished
        sequences, so a consumer waiting on it ends normally. Unknown ids are ignored.
        """
        to_abort: list[str] = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            for seq in request.sequences:
                if not seq.finished:
                    to_abort.append(seq.engine_id)
                    seq.finish_reason = str(FinishReason.ABORT)
                    seq.released = len(seq.text)
                    seq.updated = True
            if request.queue is not None:
                output = request.build_output()
                if output is not None:
                    request.queue.put(output)
            self._remove(request)
        return to_abort

    def propagate_error(self, exc: BaseException) -> list[str]:
        """Fail every request in flight with ``exc`` (e.g. EngineDeadError) and forget them.

        Returns:
            the engine-core ids of their unfinished sequences (to abort in the engine core, if it lives).
        """
        unfinished: list[str] = []
        for request in list(self._requests.values()):
            unfinished.extend(seq.engine_id for seq in request.sequences if not seq.finished)
            if request.queue is not None:
                request.queue.put(exc)
            self._remove(request)
        return unfinished

    def process_outputs(self, outputs: Sequence[EngineCoreOutput], now: float | None = None) -> OutputProcessorResult:
        """Apply one engine-core step's outputs.

        Args:
            outputs: the step's per-request outputs; ids no longer tracked (aborted) are ignored.
            now: ``time.time()`` used for metrics (default: now).
        """
        now = time.time() if now is None else now
        result = OutputProcessorResult()
        touched: dict[str, _Request] = {}
        for out in outputs:
            seq = self._sequences.get(out.request_id)
            if seq is None or seq.finished:
                continue
            request = seq.parent
            if out.finish_reason == FinishReason.ERROR:
                self._fail(seq, out.error or "unknown engine error", result)
                continue
            touched[request.request_id] = request
            self._apply(seq, out, result)
            if out.pooling_output is not None:
                request.pooled = out.pooling_output
            if out.new_token_ids:
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = now
                request.metrics.last_token_time = now
            request.num_cached_tokens = max(request.num_cached_tokens, out.num_cached_tokens)
            if out.prompt_logprobs is not None and request.prompt_logprobs is None:
                decode = seq.detok is not None
                entries = [self._logprob_entry(*entry, decode) for entry in out.prompt_logprobs]
                request.prompt_logprobs = [None, *entries]
        for request in touched.values():
            if request.errored:
                continue
            finished = request.finished
            if finished:
                request.metrics.finished_time = now
            output = request.build_output()
            for seq in request.sequences:
                seq.updated = False
            if finished:
                self._remove(request)
            if output is None:
                continue
            if request.queue is not None:
                request.queue.put(output)
            else:
                result.request_outputs.append(output)
        return result

    def _apply(self, seq: _Sequence, out: EngineCoreOutput, result: OutputProcessorResult) -> None:
        seq.updated = True
        new_ids = out.new_token_ids
        seq.token_ids.extend(new_ids)
        if seq.logprobs is not None and out.new_logprobs:
            self._append_logprobs(seq, out.new_logprobs)
        engine_finished = out.finish_reason is not None
        if seq.detok is not None:
            params = seq.params
            text_ids = new_ids
            if out.finish_reason == FinishReason.STOP and new_ids and not params.include_stop_str_in_output:
                text_ids = new_ids[:-1]  # the EOS / stop token is never text
            delta = seq.detok.push(text_ids)
            if engine_finished:
                delta += seq.detok.flush()
            old_len = len(seq.text)
            seq.text += delta
            if params.stop and delta and len(seq.token_ids) > params.min_tokens:
                match = _find_stop(seq.text, params.stop, old_len)
                if match is not None:
                    position, stop = match
                    seq.text = seq.text[: position + len(stop) if params.include_stop_str_in_output else position]
                    seq.finish_reason, seq.stop_reason = str(FinishReason.STOP), stop
                    seq.released = len(seq.text)
                    if not engine_finished:
                        result.reqs_to_abort.append(seq.engine_id)
                    return
            if engine_finished or not params.stop:
                seq.released = len(seq.text)
            else:
                seq.released = max(seq.released, len(seq.text) - held_back(seq.text, params.stop))
        if engine_finished:
            seq.finish_reason = str(out.finish_reason)
            seq.stop_reason = out.stop_reason

    def _append_logprobs(self, seq: _Sequence, new_logprobs: list[tuple[list[int], list[float], int]]) -> None:
        assert seq.logprobs is not None and seq.cumulative_logprob is not None
        decode = seq.detok is not None
        for token_ids, logprobs, sampled_rank in new_logprobs:
            seq.logprobs.append(self._logprob_entry(token_ids, logprobs, sampled_rank, decode))
            if logprobs:
                seq.cumulative_logprob += logprobs[0]

    def _logprob_entry(
        self, token_ids: list[int], logprobs: list[float], rank: int, decode: bool
    ) -> dict[int, Logprob]:
        """``(ids, logprobs, rank)`` with the chosen token first (rank ``rank``), then the top candidates
        (ranks 1, 2, ...) -> token id -> Logprob."""
        entry: dict[int, Logprob] = {}
        for position, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
            if token_id not in entry:
                entry[token_id] = Logprob(
                    logprob=logprob,
                    rank=rank if position == 0 else position,
                    decoded_token=self._view.token_text(token_id) if decode else None,
                )
        return entry

    def _fail(self, seq: _Sequence, message: str, result: OutputProcessorResult) -> None:
        request = seq.parent
        request.errored = True
        result.reqs_to_abort.extend(s.engine_id for s in request.sequences if s is not seq and not s.finished)
        if request.queue is not None:
            request.queue.put(
                EngineGenerateError(f"request {request.request_id!r} failed in the engine core: {message}")
            )
        else:
            for s in request.sequences:
                if not s.finished:
                    s.finish_reason = str(FinishReason.ABORT)
                s.released = len(s.text)
                s.updated = True
            seq.finish_reason, seq.stop_reason = ERROR_FINISH_REASON, message
            request.metrics.finished_time = time.time()
            output = request.build_output()
            assert output is not None
            result.request_outputs.append(output)
        self._remove(request)

    def _remove(self, request: _Request) -> None:
        self._requests.pop(request.request_id, None)
        for seq in request.sequences:
            self._sequences.pop(seq.engine_id, None)


def _find_stop(text: str, stops: list[str], old_len: int) -> tuple[int, str] | None:
    """Earliest stop string in ``text`` that ends after ``old_len`` (i.e. uses new text)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        position = text.find(stop, max(0, old_len - len(stop) + 1))
        if position != -1 and (best is None or position < best[0]):
            best = (position, stop)
    return best
