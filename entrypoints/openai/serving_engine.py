"""What chat and text completions share: the engine interface, tokenization off the event loop, request
checks that need the model (context length, vocabulary), per-request metrics and SSE errors."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any, Protocol, TypeVar

from tokenmill.engine.detokenizer import TokenizerView
from tokenmill.engine.input_processor import child_request_id
from tokenmill.entrypoints.openai.errors import ContextLengthExceededError, error_from_exception
from tokenmill.entrypoints.openai.protocol import listed
from tokenmill.entrypoints.openai.serving_models import OpenAIServingModels
from tokenmill.entrypoints.openai.streaming import sse_json
from tokenmill.errors import EngineDeadError, InvalidRequestError, ServerShuttingDownError
from tokenmill.metrics.stats import RequestStatsTracker
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineClient(Protocol):
    """The part of :class:`tokenmill.engine.async_llm.AsyncLLM` the server uses.

    Optional (used when present): ``add_stats_listener(fn)`` and ``async refresh_stats()`` for /metrics.
    """

    model_config: Any
    tokenizer: Any

    def generate(self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str, *,
                 priority: int = 0) -> AsyncGenerator[RequestOutput, None]: ...

    async def abort(self, request_id: str) -> None: ...

    @property
    def errored(self) -> bool: ...

    async def check_health(self) -> None: ...

    def get_num_unfinished_requests(self) -> int: ...

    def fail_all_requests(self, error: ServerShuttingDownError) -> None: ...


class Tokenization:
    """The tokenizer, used from one worker thread so long prompts never block the event loop and the
    (not thread-safe) fast tokenizer is never called concurrently. The thread starts with the first call
    (again after :meth:`shutdown`, e.g. when an app's lifespan runs twice in tests)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._executor: ThreadPoolExecutor | None = None
        self._view: TokenizerView | None = None

    @property
    def view(self) -> TokenizerView:
        """The detokenizer's view of the tokenizer (a private decoding copy; safe beside the tokenizer
        thread), made on first use."""
        if self._view is None:
            self._view = TokenizerView(self.tokenizer)
        return self._view

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the tokenizer thread."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-tokenizer")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` (call through :meth:`run`)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids))

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each id's token string as the vocabulary spells it (e.g. ``"Ġthe"``)."""
        convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        if convert is None:
            return [self.decode([t]) for t in token_ids]
        return [str(t) for t in convert(token_ids)]

    def shutdown(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


def engine_request_ids(request_id: str, n: int) -> list[str]:
    """The engine-core ids of a request's sequences (``AsyncLLM`` fans ``n > 1`` out into children)."""
    return [request_id] if n == 1 else [child_request_id(i, request_id) for i in range(n)]


class OpenAIServing:
    """Base of the chat, completion and tokenization handlers.

    Args:
        engine: the engine (an ``AsyncLLM``).
        models: the served model names.
        tokenization: the shared tokenizer worker.
        on_engine_dead: called when a request finds the engine dead (the server then shuts down).
        stats: per-request metrics (``None``: none recorded).
        return_tokens_as_token_ids: the default of the requests' ``return_tokens_as_token_ids``
            (``--return-tokens-as-token-ids``).
    """

    def __init__(self, engine: EngineClient, models: OpenAIServingModels, tokenization: Tokenization,
                 on_engine_dead: Callable[[], None], stats: RequestStatsTracker | None = None, *,
                 return_tokens_as_token_ids: bool = False) -> None:
        self.engine = engine
        self.models = models
        self.tokenization = tokenization
        self.on_engine_dead = on_engine_dead
        self.stats = stats
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.max_model_len = int(engine.model_config.max_model_len)
        self.vocab_size = int(engine.model_config.vocab_size)
        # --structured-outputs-backend, used to check constraints before a request is queued.
        so_config = getattr(getattr(engine, "engine_config", None), "structured_outputs_config", None)
        self.structured_outputs_backend = str(getattr(so_config, "backend", "auto"))
        scheduler_config = getattr(getattr(engine, "engine_config", None), "scheduler_config", None)
        self.scheduling_policy = str(getattr(scheduler_config, "policy", "fcfs"))

    def tokens_as_ids(self, requested: bool | None) -> bool:
        """Whether logprobs name tokens ``"token_id:<id>"``: the request's choice, else the server's."""
        return self.return_tokens_as_token_ids if requested is None else requested

    def check_priority(self, priority: int) -> None:
        """Raises InvalidRequestError for a non-zero ``priority`` unless the server schedules by priority
        (``--scheduling-policy priority``), as vLLM does."""
        if priority != 0 and self.scheduling_policy != "priority":
            raise InvalidRequestError(
                "priority: the server schedules first come, first served; start it with "
                "--scheduling-policy priority to use request priorities",
                param="priority",
            )

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, prompt_param: str,
                           max_tokens_param: str = "max_tokens") -> int | None:
        """Check that the prompt and ``requested`` output tokens fit the context; returns ``requested``.

        ``None`` (no limit asked) stays ``None``: the engine then generates up to the context length (or what
        the whole KV cache holds, if that is less).

        Raises:
            ContextLengthExceededError: the prompt leaves no room (``param=prompt_param``), or prompt plus
                ``requested`` exceed the context (``param=max_tokens_param``).
        """
        limit = self.max_model_len
        if prompt_len >= limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, your {prompt_param} "
                f"resulted in {prompt_len} tokens, which leaves no room for the completion. "
                f"Please reduce the length of the {prompt_param}.",
                param=prompt_param,
            )
        if requested is not None and requested >= 1 and prompt_len + requested > limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the {prompt_param}, {requested} in the "
                f"completion). Please reduce the length of the {prompt_param} or completion.",
                param=max_tokens_param,
            )
        return requested

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Raises InvalidRequestError naming the token ids outside the vocabulary (the first few of them)."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            noun = "token id" if len(bad) == 1 else "token ids"
            verb = "is" if len(bad) == 1 else "are"
            raise InvalidRequestError(
                f"{param}: {noun} {listed(bad)} {verb} out of vocabulary (valid ids are 0..{self.vocab_size - 1})",
                param=param,
            )

    def make_sampling_params(self, build: Callable[[], SamplingParams], max_tokens_param: str) -> SamplingParams:
        """Run ``build`` (a request's ``to_sampling_params``), naming ``max_tokens_param`` in its errors
        about ``max_tokens``.

        Raises:
            SamplingParamsError: a value is out of range.
        """
        try:
            return build()
        except SamplingParamsError as exc:
            if exc.param == "max_tokens" and max_tokens_param != "max_tokens":
                raise SamplingParamsError(max_tokens_param, str(exc).split(": ", 1)[-1]) from exc
            raise

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, arrival_time: float,
                 priority: int = 0, *, model_name: str | None = None, cache_salt: str | None = None
                 ) -> AsyncGenerator[RequestOutput, None]:
        """``engine.generate``, with the request's metrics recorded from its start to its end; ``model_name``
        (resolved) picks the LoRA adapter of that name, if it is one; ``cache_salt`` (the request's field)
        isolates its prefix-cache blocks."""
        extra: dict[str, Any] = {"priority": priority} if priority else {}
        if cache_salt is not None:
            extra["cache_salt"] = cache_salt
        lora_request = self.models.lora_request(model_name)
        if lora_request is not None:
            extra["lora_request"] = lora_request
        gen = self.engine.generate(prompt_ids, params, request_id, **extra)
        if self.stats is None:
            return gen
        return self._tracked(gen, engine_request_ids(request_id, params.n), arrival_time, len(prompt_ids))

    async def _tracked(self, gen: AsyncGenerator[RequestOutput, None], engine_ids: list[str], arrival_time: float,
                       prompt_len: int) -> AsyncGenerator[RequestOutput, None]:
        stats = self.stats
        assert stats is not None
        stats.start(engine_ids, arrival_time, prompt_len)
        reasons: dict[int, str] = {}
        failure: BaseException | None = None
        try:
            async with aclosing(gen):
                async for output in gen:
                    for o in output.outputs:
                        if o.finish_reason is not None:
                            reasons[o.index] = o.finish_reason
                    yield output
        except BaseException as exc:
            failure = exc
            raise
        finally:
            now = time.time()
            rejected = isinstance(failure, InvalidRequestError) and not reasons
            default = "error" if isinstance(failure, Exception) else "abort"
            for index, engine_id in enumerate(engine_ids):
                if rejected:
                    stats.discard(engine_id)
                else:
                    stats.finish(engine_id, reasons.get(index, default), now)

    def sse_error(self, exc: BaseException, request_id: str) -> str:
        """The ``data: {"error": ...}`` event for an exception raised inside a stream."""
        if isinstance(exc, EngineDeadError):
            logger.error("request %s: engine core is dead: %s", request_id, exc)
            self.on_engine_dead()
        elif isinstance(exc, ServerShuttingDownError):
            logger.info("request %s stopped: the server is shutting down", request_id)
        elif not isinstance(exc, InvalidRequestError):
            logger.error("request %s failed while streaming", request_id, exc_info=exc)
        _, body = error_from_exception(exc)
        return sse_json(body)
