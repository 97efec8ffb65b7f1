"""A fake ``AsyncLLM`` and tokenizer: the server's logic tested without a model.

The tokenizer is one token per character (id = code point); the engine "generates" a fixed reply one
character per token, honouring ``max_tokens``, ``n``, ``logprobs``, ``prompt_logprobs`` and the output kind,
and records what it was asked (sampling params, aborts) so tests can check the server's side of the contract.
Like ``AsyncLLM`` it reports every step to its stats listeners (engine-core outputs with queued / scheduled
events and scheduler stats), so the server's metrics can be tested too. Sampling params are msgpack-encoded
as the real ZMQ hop does, so values the real engine could not carry fail here too.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import jinja2
import jinja2.sandbox
import msgspec
from tokenmill.engine.input_processor import child_request_id
from tokenmill.engine.messages import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerStats,
)
from tokenmill.errors import EngineDeadError, InvalidRequestError
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.worker.request_logits_processors import check_request_processors

REPLY = "Paris is the capital of France."
VOCAB_SIZE = 1000
SERVED_NAME = "fake-org/fake-model"
DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def server_args(**overrides: object) -> argparse.Namespace:
    """The ``args`` of ``build_app`` with server defaults (no API key, the tokenizer's chat template)."""
    args = argparse.Namespace(api_key=None, chat_template=None)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


class FakeTokenizer:
    """One token per character; ids are code points (below ``VOCAB_SIZE`` for the text tests use)."""

    def __init__(self) -> None:
        self.chat_template: str | None = DEFAULT_TEMPLATE
        self.bos_token = None
        self.eos_token = "</s>"

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: Any = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            **kwargs: Any) -> str | list[int]:
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("tokenizer.chat_template is not set")

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment()
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(template).render(messages=conversation, tools=tools,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text) if tokenize else text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        return "".join(chr(t) for t in token_ids)


@dataclass
class Call:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None


@dataclass
class FakeAsyncLLM:
    """Same interface as ``tokenmill.engine.async_llm.AsyncLLM``.

    Knobs: ``delay_s`` between tokens; ``fail_with`` raised before the first output; ``die_after`` tokens
    after which ``EngineDeadError`` is raised (and ``errored`` turns true); ``cached_tokens`` reported;
    ``logits_processor_pattern`` checks per-request logits processors as the engine's front end does.
    """

    max_model_len: int = 128
    delay_s: float = 0.0
    fail_with: BaseException | None = None
    die_after: int | None = None
    cached_tokens: int = 0
    logits_processor_pattern: str | None = None  # the engine's --logits-processor-pattern
    reply: str = REPLY
    dead: bool = False
    stop_error: BaseException | None = None
    calls: list[Call] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    active: set[str] = field(default_factory=set)
    shutdown_called: bool = False
    on_abort: Callable[[str], None] | None = None
    stats_listeners: list[Callable[[EngineCoreOutputs, float], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.model_config = SimpleNamespace(max_model_len=self.max_model_len, served_model_name=SERVED_NAME,
                                            vocab_size=VOCAB_SIZE, model="/models/fake")
        self.engine_config = SimpleNamespace(model_config=self.model_config)

    @property
    def errored(self) -> bool:
        return self.dead

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError("fake engine is dead")

    def add_stats_listener(self, listener: Callable[[EngineCoreOutputs, float], None]) -> None:
        self.stats_listeners.append(listener)

    def _stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.active), num_waiting_reqs=0,
                              kv_cache_usage=min(1.0, 0.01 * len(self.active)))

    def _notify(self, outputs: list[EngineCoreOutput]) -> None:
        batch = EngineCoreOutputs(outputs=outputs, scheduler_stats=self._stats())
        for listener in self.stats_listeners:
            listener(batch, time.time())

    async def refresh_stats(self) -> SchedulerStats:
        stats = self._stats()
        for listener in self.stats_listeners:
            listener(EngineCoreOutputs(scheduler_stats=stats), time.time())
        return stats

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.active.discard(request_id)

    def shutdown(self) -> None:
        self.shutdown_called = True

    def get_num_unfinished_requests(self) -> int:
        return len(self.active)

    def fail_all_requests(self, error: BaseException) -> None:
        self.stop_error = error

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        self.calls.append(Call(request_id, prompt, sampling_params, priority, cache_salt))
        msgspec.msgpack.encode(sampling_params)  # what the real engine sends over ZMQ must encode
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("prompt: must not be empty", param="prompt")
        if any(not 0 <= t < VOCAB_SIZE for t in ids):
            raise InvalidRequestError("prompt: token id out of vocabulary", param="prompt")
        check_request_processors(sampling_params.logits_processors, self.logits_processor_pattern)
        max_tokens = sampling_params.max_tokens or (self.max_model_len - len(ids))
        if len(ids) + max_tokens > self.max_model_len:
            raise InvalidRequestError("max_tokens: too long", param="max_tokens")
        if self.dead:
            raise EngineDeadError("fake engine is dead")
        if self.stop_error is not None:
            raise self.stop_error
        if self.fail_with is not None:
            raise self.fail_with
        self.active.add(request_id)
        finished = False
        engine_ids = [request_id] if sampling_params.n == 1 else [
            child_request_id(i, request_id) for i in range(sampling_params.n)]
        queued = time.time()
        try:
            texts = {i: "" for i in range(sampling_params.n)}
            tokens: dict[int, list[int]] = {i: [] for i in range(sampling_params.n)}
            logprobs: dict[int, list[dict[int, Logprob]]] = {i: [] for i in range(sampling_params.n)}
            steps = min(max_tokens, len(self.reply))
            for step in range(steps):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                else:
                    await asyncio.sleep(0)
                if self.stop_error is not None:
                    raise self.stop_error
                if self.die_after is not None and step >= self.die_after:
                    self.dead = True
                    raise EngineDeadError("fake engine died")
                last = step == steps - 1
                reason = None
                if last:
                    reason = "stop" if max_tokens > len(self.reply) else "length"
                deltas = []
                for i in range(sampling_params.n):
                    ch = self.reply[step]
                    lp = self._logprobs(ch, sampling_params.logprobs)
                    texts[i] += ch
                    tokens[i].append(ord(ch))
                    if lp is not None:
                        logprobs[i].append(lp)
                    deltas.append(CompletionOutput(index=i, text=ch, token_ids=[ord(ch)],
                                                   logprobs=[lp] if lp is not None else None,
                                                   finish_reason=reason))
                finished = last
                if last:
                    self.active.discard(request_id)
                events = [EngineCoreEvent(EngineCoreEventType.QUEUED, queued),
                          EngineCoreEvent(EngineCoreEventType.SCHEDULED, queued)] if step == 0 else None
                self._notify([EngineCoreOutput(eid, [ord(self.reply[step])], events=events) for eid in engine_ids])
                prompt_lps = self._prompt_logprobs(ids, sampling_params.prompt_logprobs) if step == 0 else None
                if sampling_params.output_kind == RequestOutputKind.DELTA:
                    yield RequestOutput(request_id, None, ids, deltas, finished=last,
                                        num_cached_tokens=self.cached_tokens, prompt_logprobs=prompt_lps)
            if sampling_params.output_kind != RequestOutputKind.DELTA:
                outputs = [
                    CompletionOutput(index=i, text=texts[i], token_ids=tokens[i],
                                     logprobs=logprobs[i] if sampling_params.logprobs is not None else None,
                                     finish_reason=deltas[i].finish_reason)
                    for i in range(sampling_params.n)
                ]
                yield RequestOutput(request_id, None, ids, outputs, finished=True,
                                    num_cached_tokens=self.cached_tokens,
                                    prompt_logprobs=self._prompt_logprobs(ids, sampling_params.prompt_logprobs))
        finally:
            self.active.discard(request_id)
            if not finished:
                self.aborted.append(request_id)
                if self.on_abort is not None:
                    self.on_abort(request_id)

    @staticmethod
    def _prompt_logprobs(ids: list[int], k: int | None) -> list[dict[int, Logprob] | None] | None:
        """``None`` for the first prompt token, then the actual token at -1.0 (rank 2) and ``k`` candidates."""
        if k is None:
            return None
        entries: list[dict[int, Logprob] | None] = [None]
        for t in ids[1:]:
            entry = {t: Logprob(-1.0, rank=2, decoded_token=chr(t))}
            for r in range(k):
                alt = ord("a") + r
                if alt not in entry:
                    entry[alt] = Logprob(-0.5 - r, rank=r + 1, decoded_token=chr(alt))
            entries.append(entry)
        return entries

    @staticmethod
    def _logprobs(ch: str, k: int | None) -> dict[int, Logprob] | None:
        if k is None:
            return None
        entry = {ord(ch): Logprob(-0.25, rank=1, decoded_token=ch)}
        for r in range(k):
            alt = chr(ord("a") + r)
            if ord(alt) not in entry:
                entry[ord(alt)] = Logprob(-2.0 - r, rank=r + 2, decoded_token=alt)
        return entry
