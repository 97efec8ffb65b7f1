"""What the request handlers share: the engine interface, tokenization off the event loop, the
:class:`ServingContext` built once per app, and :class:`OpenAIServing` with the steps of a request (checks that
need the model, chat template, tool calling and structured outputs, metrics, client disconnects, stream
errors)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import Request
from tokenmill.engine.detokenizer import TokenizerView
from tokenmill.engine.input_processor import child_request_id
from tokenmill.entrypoints.openai.chat_template import ChatRenderer
from tokenmill.entrypoints.openai.errors import ContextLengthExceededError, error_from_exception
from tokenmill.entrypoints.openai.protocol import listed
from tokenmill.entrypoints.openai.serving_models import OpenAIServingModels
from tokenmill.entrypoints.openai.streaming import close_quietly, run_unless_disconnected, sse_json
from tokenmill.entrypoints.openai.structured_outputs import check_structured_outputs
from tokenmill.entrypoints.openai.tool_choice import ToolCalling
from tokenmill.tool_parsers import ToolParser
from tokenmill.multimodal.media import MediaConnector
from tokenmill.errors import EngineDeadError, EngineGenerateError, InvalidRequestError, ServerShuttingDownError
from tokenmill.metrics.stats import RequestStatsTracker
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.reasoning import ReasoningParser
from tokenmill.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError, StructuredOutputsParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
Gen = AsyncGenerator[RequestOutput, None]


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


@dataclass(frozen=True)
class ServingContext:
    """What every handler of one app shares, built once by ``build_app``.

    Attributes:
        engine: the engine (an ``AsyncLLM``).
        models: the served model names.
        tokenization: the shared tokenizer worker.
        renderer: the chat template (``--chat-template``, else the tokenizer's).
        on_engine_dead: called when a request finds the engine dead (the server then shuts down).
        stats: per-request metrics (``None``: none recorded).
        tool_parser_cls: the ``--tool-call-parser`` class when ``--enable-auto-tool-choice`` is on, else
            ``None`` (``tool_choice`` ``auto`` with tools is then refused).
        return_tokens_as_token_ids: the default of the requests' ``return_tokens_as_token_ids``
            (``--return-tokens-as-token-ids``).
        reasoning_parser_cls: the ``--reasoning-parser`` class (``None``: the thinking stays in the content).
    """

    engine: EngineClient
    models: OpenAIServingModels
    tokenization: Tokenization
    renderer: ChatRenderer
    on_engine_dead: Callable[[], None]
    stats: RequestStatsTracker | None = None
    tool_parser_cls: type[ToolParser] | None = None
    return_tokens_as_token_ids: bool = False
    reasoning_parser_cls: type[ReasoningParser] | None = None


class GenerateRequest(Protocol):
    """The fields :meth:`OpenAIServing.admit` reads from a generating request (chat, completion, Responses)."""

    model: str | None
    priority: int

    def check(self) -> None: ...


def output_kind(stream: bool) -> RequestOutputKind:
    """Deltas for a stream, else only the final output."""
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


async def gather_or_cancel(*aws: Awaitable[T]) -> list[T]:
    """``asyncio.gather`` that cancels the others when one fails (or when the caller is cancelled)."""
    tasks: list[asyncio.Future[T]] = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def collect_outputs(gen: Gen) -> tuple[RequestOutput | None, dict[int, CompletionOutput]]:
    """Run ``gen`` to its end: its last output and the last state of each sequence (by ``index``)."""
    last: RequestOutput | None = None
    by_index: dict[int, CompletionOutput] = {}
    async with aclosing(gen):
        async for out in gen:
            last = out
            for o in out.outputs:
                by_index[o.index] = o
    return last, by_index


class OpenAIServing:
    """Base of the request handlers: the chat, completion, Responses and tokenization servers (and any other
    API front end over the same engine).

    It holds the :class:`ServingContext` (its fields are attributes) and the steps every generating request
    takes: :meth:`admit` (model, fields, priority), :meth:`resolve_structured_outputs` (tool calling and
    constraints, compile-checked), :meth:`encode_chat` (chat template), :meth:`resolve_max_tokens`,
    :meth:`make_sampling_params`, :meth:`generate` (with metrics), then :meth:`full_outputs` or
    :meth:`first_outputs` (both aware of client disconnects) and :meth:`log_stream_error` / :meth:`sse_error`.
    """

    def __init__(self, context: ServingContext) -> None:
        self.context = context
        engine = context.engine
        self.engine = engine
        self.models = context.models
        self.tokenization = context.tokenization
        self.renderer = context.renderer
        self.on_engine_dead = context.on_engine_dead
        self.stats = context.stats
        self.tool_parser_cls = context.tool_parser_cls
        self.reasoning_parser_cls = context.reasoning_parser_cls
        self.return_tokens_as_token_ids = context.return_tokens_as_token_ids
        self.max_model_len = int(engine.model_config.max_model_len)
        self.vocab_size = int(engine.model_config.vocab_size)
        # --structured-outputs-backend, used to check constraints before a request is queued.
        so_config = getattr(getattr(engine, "engine_config", None), "structured_outputs_config", None)
        self.structured_outputs_backend = str(getattr(so_config, "backend", "auto"))
        scheduler_config = getattr(getattr(engine, "engine_config", None), "scheduler_config", None)
        self.scheduling_policy = str(getattr(scheduler_config, "policy", "fcfs"))
        mm_config = getattr(getattr(engine, "engine_config", None), "multimodal_config", None)
        self.media = MediaConnector(getattr(mm_config, "allowed_local_media_path", None),
                                    bool(getattr(mm_config, "allow_http", False)))

    def admit(self, request: GenerateRequest) -> str:
        """The first checks of a generating request; returns the resolved model name.

        Raises:
            ModelNotFoundError: unknown ``model``.
            InvalidRequestError: invalid fields (``request.check()``) or a priority the server does not use.
        """
        model_name = self.models.resolve(request.model)
        request.check()
        self.check_priority(request.priority)
        return model_name

    def log_request(self, request_id: str, raw_request: Request, detail: str, *args: Any) -> None:
        """One info line per request, with the client's ``X-Request-Id``; ``detail % args`` describes it."""
        logging.getLogger(type(self).__module__).info(
            "request %s (X-Request-Id %s): " + detail, request_id, getattr(raw_request.state, "request_id", "-"),
            *args)

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

    def tool_parser_factory(self) -> Callable[[], ToolParser] | None:
        """Makes a fresh ``--tool-call-parser`` for one request (``None`` without ``--enable-auto-tool-choice``)."""
        parser_cls = self.tool_parser_cls
        if parser_cls is None:
            return None
        tokenizer = self.tokenization.tokenizer
        return lambda: parser_cls(tokenizer)

    async def resolve_structured_outputs(self, constraint: StructuredOutputsParams | None, source: str | None,
                                         tool_calling: ToolCalling | None = None, conflict_param: str | None = None
                                         ) -> StructuredOutputsParams | None:
        """The request's one constraint, compile-checked with the server's backend in the tokenizer thread (the
        first check imports the grammar library), so that a bad one is a 400 before anything is queued.

        Args:
            constraint: what the request's own fields ask for (``None``: nothing); ``source`` names that field.
            tool_calling: the request's tool handling; ``tool_choice`` ``required`` / a named function bring a
                constraint of their own, which the request's may not be combined with.
            conflict_param: the field named when both are given (default: ``source`` up to its first dot).

        Raises:
            InvalidRequestError: two constraints at once, or one that does not compile (``param`` names the
                field).
        """
        if tool_calling is not None and tool_calling.structured_outputs is not None:
            if source is not None:
                field = conflict_param or source.split(".", 1)[0]
                raise InvalidRequestError(
                    f"{field}: cannot be combined with tool_choice 'required' or a named function", param=field
                )
            constraint, source = tool_calling.structured_outputs, "tool_choice"
        if constraint is None or source is None:
            return None
        return await self.tokenization.run(check_structured_outputs, constraint, self.structured_outputs_backend,
                                           source)

    def encode_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                    continue_final_message: bool, template_kwargs: dict[str, Any] | None,
                    add_special_tokens: bool, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of ``messages`` through the chat template (call through ``self.tokenization.run``).

        Raises:
            InvalidRequestError: see :meth:`ChatRenderer.render`.
        """
        text = self.renderer.render(messages, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, template_kwargs=template_kwargs,
                                    tools=tools)
        return self.tokenization.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat_with_images(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                                continue_final_message: bool, template_kwargs: dict[str, Any] | None,
                                add_special_tokens: bool, tools: list[dict[str, Any]] | None = None,
                                mm_processor_kwargs: dict[str, Any] | None = None
                                ) -> tuple[list[int], list[Any] | None]:
        """:meth:`encode_chat` for messages that may hold image parts: ``(token ids, None)`` without images;
        with images, the ids with each placeholder expanded by the model's processor and the images' features
        (call through ``self.tokenization.run``).

        Raises:
            InvalidRequestError: an image that cannot be loaded or decoded (``param`` names the content part),
                a text-only model, more images than ``--limit-mm-per-prompt``, or the template or processor
                failed (``param="messages"``).
        """
        from tokenmill.multimodal.chat_parts import render_messages_with_images

        rendered, images = render_messages_with_images(messages, self.media)
        if not images:
            return self.encode_chat(rendered, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, template_kwargs=template_kwargs,
                                    add_special_tokens=add_special_tokens, tools=tools), None
        processor = self.engine.input_processor.mm_processor  # type: ignore[attr-defined]
        processor.check_images(len(images), "messages")
        text = self.renderer.render(rendered, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, template_kwargs=template_kwargs,
                                    tools=tools)
        return processor.process(text, images, add_special_tokens=add_special_tokens, param="messages",
                                 mm_processor_kwargs=mm_processor_kwargs)

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, arrival_time: float,
                 priority: int = 0, *, model_name: str | None = None, cache_salt: str | None = None,
                 mm_features: list[Any] | None = None) -> AsyncGenerator[RequestOutput, None]:
        """``engine.generate``, with the request's metrics recorded from its start to its end; ``model_name``
        (resolved) picks the LoRA adapter of that name, if it is one; ``cache_salt`` (the request's field)
        isolates its prefix-cache blocks; ``mm_features`` are the prompt's processed images."""
        extra: dict[str, Any] = {"priority": priority} if priority else {}
        if mm_features:
            extra["mm_features"] = mm_features
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

    async def full_outputs(self, raw_request: Request, gens: list[Gen], request_id: str
                           ) -> list[tuple[RequestOutput, dict[int, CompletionOutput]]] | None:
        """Each generator's last output and the last state of its sequences (see :func:`collect_outputs`), run
        concurrently; ``None`` when the client disconnected first (the requests are then aborted).

        Raises:
            EngineGenerateError: a generator ended without output.
            EngineDeadError, InvalidRequestError, ...: from the engine.
        """
        completed, results = await run_unless_disconnected(raw_request,
                                                           gather_or_cancel(*map(collect_outputs, gens)))
        if not completed or results is None:
            logger.info("request %s: client disconnected, aborted", request_id)
            return None
        checked = []
        for last, by_index in results:
            if last is None:
                raise EngineGenerateError(f"request {request_id}: the engine returned no output")
            checked.append((last, by_index))
        return checked

    async def first_outputs(self, raw_request: Request, gens: list[Gen], request_id: str
                            ) -> list[RequestOutput | None] | None:
        """Each generator's first output (``None`` for one that ended at once), awaited before a stream is
        answered so that a request the engine rejects gets a plain 4xx rather than a stream that starts and
        then fails; ``None`` when the client disconnected first. The generators are closed when this returns
        ``None`` or raises.
        """
        try:
            completed, firsts = await run_unless_disconnected(
                raw_request, gather_or_cancel(*(anext(g, None) for g in gens))
            )
        except BaseException:
            for g in gens:
                await close_quietly(g)
            raise
        if not completed or firsts is None:
            for g in gens:
                await close_quietly(g)
            logger.info("request %s: client disconnected, aborted", request_id)
            return None
        return firsts

    def log_stream_error(self, exc: BaseException, request_id: str) -> None:
        """Log an exception raised inside a stream (an engine found dead also shuts the server down)."""
        if isinstance(exc, EngineDeadError):
            logger.error("request %s: engine core is dead: %s", request_id, exc)
            self.on_engine_dead()
        elif isinstance(exc, ServerShuttingDownError):
            logger.info("request %s stopped: the server is shutting down", request_id)
        elif not isinstance(exc, InvalidRequestError):
            logger.error("request %s failed while streaming", request_id, exc_info=exc)

    def sse_error(self, exc: BaseException, request_id: str) -> str:
        """The ``data: {"error": ...}`` event for an exception raised inside a stream (logged)."""
        self.log_stream_error(exc, request_id)
        _, body = error_from_exception(exc)
        return sse_json(body)
