"""InputProcessor: a user's prompt and SamplingParams -> validated EngineCoreRequest(s)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from tokenmill.config import CacheConfig, ModelConfig, MultiModalConfig, StructuredOutputsConfig
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.errors import InvalidRequestError
from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.pooler_config import check_pooling_params
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError


def child_request_id(index: int, parent_id: str) -> str:
    """Engine-core id of the ``index``-th sequence of a request with ``n > 1``."""
    return f"{index}_{parent_id}"


@dataclass(frozen=True, kw_only=True)
class RequestInput:
    """One request as a front end (``LLMEngine.add_request``, ``AsyncLLM.generate``) hands it to the
    :class:`InputProcessor`.

    Attributes:
        request_id: unique among requests in flight.
        prompt: text, or token ids.
        params: sampling parameters (not modified; a resolved copy is used), or PoolingParams for a pooling
            request (see :meth:`InputProcessor.process_pooling`).
        arrival_time: ``time.time()`` of arrival (default: when it is processed).
        priority: for the ``priority`` scheduling policy (lower runs first).
        add_special_tokens: let the tokenizer add BOS etc. (``False`` for rendered chat templates).
        prompt_param: the name errors give the prompt (``"messages"`` for chat requests).
        lora_request: the LoRA adapter to use (``None``: the base model).
        cache_salt: mixed into the prefix-cache hashes of the request's blocks, so that only requests with the
            same salt share cached blocks (``None``: no salt).
        multi_modal_data: vLLM's ``{"image": PIL image or list}`` for a text prompt holding the model's image
            placeholders; the model's processor expands them (docs/multimodal.md).
        mm_processor_kwargs: per-request options for that processor.
        mm_features: images already processed (by the server's tokenizer thread); ``prompt`` is then the
            expanded token ids.
    """

    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams | PoolingParams
    arrival_time: float | None = None
    priority: int = 0
    add_special_tokens: bool = True
    prompt_param: str = "prompt"
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    multi_modal_data: Mapping[str, Any] | None = None
    mm_processor_kwargs: Mapping[str, Any] | None = None
    mm_features: list[MultiModalFeature] | None = None


@dataclass
class ProcessedRequest:
    """A validated request, ready for the output processor and the engine core.

    Attributes:
        request_id: the caller's id.
        prompt: the prompt text (``None`` when given as token ids).
        prompt_token_ids: the tokenized prompt.
        params: the request's sampling parameters (``max_tokens`` resolved).
        arrival_time: ``time.time()`` when it arrived (seconds).
        engine_requests: what the engine core runs: one request, or ``n`` children with ``n == 1`` each
            (ids from :func:`child_request_id`, seeds ``seed + i``).
        pooling_params: set for a pooling request (``params`` is then a placeholder).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    engine_requests: list[EngineCoreRequest]
    pooling_params: PoolingParams | None = None


class InputProcessor:
    """Tokenizes and validates prompts.

    Args:
        model_config: supplies ``max_model_len``, ``vocab_size`` and extra EOS ids.
        tokenizer: a ``transformers`` tokenizer.
        cache_config: when ``num_gpu_blocks`` is known, requests larger than the whole KV cache are rejected
            up front instead of failing inside the engine core.
        structured_outputs_config: the engine's structured-output backend (constraints are checked, and
            ``auto`` resolved, here; default ``auto``).
        logits_processor_pattern: which per-request logits processors requests may name (``None``: none).
        speculative: the engine decodes speculatively (per-request logits processors are then refused).
        mm_config: image limits and processor options (default: no limits).
    """

    def __init__(self, model_config: ModelConfig, tokenizer: Any, cache_config: CacheConfig | None = None,
                 structured_outputs_config: StructuredOutputsConfig | None = None, *,
                 logits_processor_pattern: str | None = None, speculative: bool = False,
                 mm_config: MultiModalConfig | None = None) -> None:
        self.model_config = model_config
        self.mm_config = mm_config or MultiModalConfig()
        self._mm_processor: Any = None
        self.logits_processor_pattern = logits_processor_pattern
        self.speculative = speculative
        self.structured_outputs_backend = (structured_outputs_config or StructuredOutputsConfig()).backend
        self.tokenizer = tokenizer
        self.cache_config = cache_config
        eos = getattr(tokenizer, "eos_token_id", None)
        model_eos = model_config.eos_token_ids
        self.eos_token_id: int | None = int(eos) if eos is not None else (model_eos[0] if model_eos else None)
        vocab = model_config.vocab_size
        self._extra_eos_ids = [t for t in model_eos if t != self.eos_token_id and 0 <= t < vocab]

    def process(self, request: RequestInput) -> ProcessedRequest:
        """Tokenize (when the prompt is text), validate and build the engine-core request(s).

        Raises:
            InvalidRequestError: empty prompt, token id outside the vocabulary (in the prompt, ``logit_bias``,
                ``allowed_token_ids``, ``stop_token_ids``, ``bad_words_token_ids`` or tokenized ``bad_words``),
                prompt + ``max_tokens`` longer than the context or than the whole KV cache, stop strings
                without detokenization, an invalid structured-output constraint, per-request logits processors
                that are not allowed or cannot be built (``param`` names the field).
        """
        if isinstance(request.params, PoolingParams):
            return self.process_pooling(request)
        request_id, prompt, params, prompt_param = request.request_id, request.prompt, request.params, \
            request.prompt_param
        mc = self.model_config
        if mc.runner_type == "pooling" and not any(a.endswith("ForCausalLM") for a in mc.architectures):
            raise InvalidRequestError(
                f"this model ({', '.join(mc.architectures)}) is served with the 'pooling' runner and has no LM "
                "head: it cannot generate text (use the embeddings, classify, score or rerank routes)",
                param="model",
            )
        arrival = time.time() if request.arrival_time is None else request.arrival_time
        prompt_text, token_ids, mm_features = self._tokenize_with_images(request)
        self._check_prompt(token_ids, prompt_param)
        check_token_ids_in_vocab(params, self.model_config.vocab_size)
        if params.logits_processors:
            from tokenmill.worker.request_logits_processors import check_request_processors

            check_request_processors(params.logits_processors, self.logits_processor_pattern, self.speculative)
        params = self._resolve_params(params, len(token_ids), prompt_param)
        return ProcessedRequest(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=token_ids,
            params=params,
            arrival_time=arrival,
            engine_requests=self._engine_requests(request_id, token_ids, params, arrival, request.priority,
                                                  request.lora_request, request.cache_salt, mm_features),
        )

    def process_pooling(self, request: RequestInput) -> ProcessedRequest:
        """Tokenize and validate a pooling request (embedding, classification, scoring).

        The task defaults to the model's (``embed``, or ``classify`` for a classifier). A prompt longer than the
        context length is refused unless ``truncate_prompt_tokens`` asks to keep only its last ``k`` tokens
        (``-1``: the context length), as vLLM truncates.

        Raises:
            InvalidRequestError: the engine does not run the pooling runner, the prompt is empty, too long or
                has out-of-vocabulary ids, or the model cannot do what ``params`` asks (``param`` names why).
        """
        request_id, prompt, params, prompt_param = request.request_id, request.prompt, request.params, \
            request.prompt_param
        assert isinstance(params, PoolingParams)
        mc = self.model_config
        if mc.runner_type != "pooling":
            raise InvalidRequestError(
                f"this model is served with the {mc.runner_type!r} runner, which does not do pooling "
                "(embeddings, classification, scores); serve an embedding or classification model, or pass "
                "--runner pooling", param="model",
            )
        arrival = time.time() if request.arrival_time is None else request.arrival_time
        prompt_text, token_ids = self._tokenize(prompt, request.add_special_tokens, prompt_param)
        if params.task is None:
            params = params.with_task("classify" if mc.convert == "classify" else "embed")
        max_len = mc.max_model_len
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = max_len if keep == -1 else keep
            if keep > max_len:
                raise InvalidRequestError(
                    f"truncate_prompt_tokens: {keep} is more than the context length {max_len}",
                    param="truncate_prompt_tokens",
                )
            token_ids = token_ids[-keep:]
        self._check_prompt(token_ids, prompt_param)
        if len(token_ids) > max_len:
            raise InvalidRequestError(
                f"{prompt_param}: this model's maximum context length is {max_len} tokens, but the input has "
                f"{len(token_ids)} tokens; shorten it or pass truncate_prompt_tokens", param=prompt_param,
            )
        check_pooling_params(params, mc.pooler_config, mc.convert, int(mc.hf_config.hidden_size),
                             int(getattr(mc.hf_config, "num_labels", 1) or 1))
        placeholder = SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        engine_request = EngineCoreRequest(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=placeholder,
            arrival_time=arrival, priority=request.priority, lora_request=request.lora_request,
            pooling_params=params,
        )
        return ProcessedRequest(
            request_id=request_id, prompt=prompt_text, prompt_token_ids=token_ids, params=placeholder,
            arrival_time=arrival, engine_requests=[engine_request], pooling_params=params,
        )

    @property
    def mm_processor(self) -> Any:
        """The :class:`~tokenmill.multimodal.processing.MultiModalProcessor` (built on first use)."""
        if self._mm_processor is None:
            from tokenmill.multimodal.processing import MultiModalProcessor

            self._mm_processor = MultiModalProcessor(self.model_config, self.mm_config)
        return self._mm_processor

    def _tokenize_with_images(self, request: RequestInput
                              ) -> tuple[str | None, list[int], list[MultiModalFeature] | None]:
        """``(text, token ids, image features)``: the images of ``multi_modal_data`` processed with the prompt,
        or ``mm_features`` a front end already processed (checked against the model and the limit)."""
        param = request.prompt_param
        if request.mm_features:
            self.mm_processor.check_images(len(request.mm_features), param)
            prompt_text, token_ids = self._tokenize(request.prompt, request.add_special_tokens, param)
            return prompt_text, token_ids, list(request.mm_features)
        if request.multi_modal_data:
            from tokenmill.multimodal.processing import image_list

            images = image_list(request.multi_modal_data, param)
            if images:
                if isinstance(request.prompt, str):
                    _check_encodable(request.prompt, param)
                token_ids, features = self.mm_processor.process(
                    request.prompt, images, add_special_tokens=request.add_special_tokens, param=param,  # type: ignore[arg-type]
                    mm_processor_kwargs=request.mm_processor_kwargs)
                return request.prompt, token_ids, features  # type: ignore[return-value]
        prompt_text, token_ids = self._tokenize(request.prompt, request.add_special_tokens, param)
        return prompt_text, token_ids, None

    def _tokenize(self, prompt: str | Sequence[int], add_special_tokens: bool, prompt_param: str
                  ) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt given as text or as token ids."""
        if not isinstance(prompt, str):
            return None, list(prompt)
        _check_encodable(prompt, prompt_param)
        return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)) if prompt else []

    def _check_prompt(self, token_ids: list[int], prompt_param: str) -> None:
        if not token_ids:
            raise InvalidRequestError(f"{prompt_param}: the prompt must not be empty", param=prompt_param)
        vocab = self.model_config.vocab_size
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"{prompt_param}: token id {t!r} is out of vocabulary (valid ids are 0..{vocab - 1})",
                    param=prompt_param,
                )

    def _resolve_params(self, params: SamplingParams, prompt_len: int, prompt_param: str) -> SamplingParams:
        max_len = self.model_config.max_model_len
        if prompt_len >= max_len:
            raise InvalidRequestError(
                f"{prompt_param}: this model's maximum context length is {max_len} tokens, but the prompt has "
                f"{prompt_len} tokens (at least one token must be left for the completion)",
                param=prompt_param,
            )
        if params.max_tokens is not None and prompt_len + params.max_tokens > max_len:
            raise InvalidRequestError(
                f"max_tokens: this model's maximum context length is {max_len} tokens, but "
                f"{prompt_len + params.max_tokens} were requested ({prompt_len} in the prompt, "
                f"{params.max_tokens} for the completion); reduce the prompt or max_tokens",
                param="max_tokens",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - prompt_len
        max_tokens = self._fit_kv_cache(prompt_len, max_tokens, params.max_tokens is not None, prompt_param)
        if params.stop and not params.detokenize:
            raise InvalidRequestError("stop: stop strings need detokenize=True", param="stop")
        if max_tokens < params.min_tokens:
            raise InvalidRequestError(
                f"min_tokens: only {max_tokens} tokens fit after the prompt, but min_tokens is {params.min_tokens}",
                param="min_tokens",
            )
        changes: dict[str, Any] = {"max_tokens": max_tokens}
        if params.bad_words:
            changes["bad_words_token_ids"] = self._bad_words_token_ids(params)
        if params.structured_outputs is not None:
            from tokenmill.structured_output.validation import resolve_structured_outputs

            changes["structured_outputs"] = resolve_structured_outputs(
                params.structured_outputs, self.structured_outputs_backend
            )
        return msgspec.structs.replace(params, **changes)

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """``bad_words`` tokenized (alone and after a space, so both spellings are banned), plus any
        ``bad_words_token_ids`` already given."""
        sequences = [list(s) for s in params.bad_words_token_ids or []]
        vocab = self.model_config.vocab_size
        for word in params.bad_words or []:
            stripped = word.lstrip()
            if not stripped:
                continue
            for text in (stripped, " " + stripped):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                _check_ids_in_vocab("bad_words", ids, vocab)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _fit_kv_cache(self, prompt_len: int, max_tokens: int, explicit: bool, prompt_param: str) -> int:
        """``max_tokens``, lowered to what the whole KV cache holds when the user did not set it."""
        cache = self.cache_config
        if cache is None or not cache.num_gpu_blocks:
            return max_tokens
        capacity = cache.num_gpu_blocks * cache.block_size
        if prompt_len + max_tokens <= capacity:
            return max_tokens
        if prompt_len >= capacity:
            raise InvalidRequestError(
                f"{prompt_param}: the prompt has {prompt_len} tokens but the KV cache holds only {capacity} "
                "(at least one token must be left for the completion)",
                param=prompt_param,
            )
        if explicit:
            raise InvalidRequestError(
                f"max_tokens: the KV cache holds {capacity} tokens, but this request needs up to "
                f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} for the completion)",
                param="max_tokens",
            )
        return capacity - prompt_len

    def _engine_requests(
        self, request_id: str, token_ids: list[int], params: SamplingParams, arrival: float, priority: int,
        lora_request: LoRARequest | None = None, cache_salt: str | None = None,
        mm_features: list[MultiModalFeature] | None = None,
    ) -> list[EngineCoreRequest]:
        base = params
        if self._extra_eos_ids and not params.ignore_eos:
            extra = [t for t in self._extra_eos_ids if t not in params.stop_token_ids]
            base = msgspec.structs.replace(params, stop_token_ids=[*params.stop_token_ids, *extra])
        if params.n == 1:
            ids_and_params = [(request_id, base)]
        else:
            ids_and_params = [
                (
                    child_request_id(i, request_id),
                    msgspec.structs.replace(base, n=1, seed=None if base.seed is None else _child_seed(base.seed, i)),
                )
                for i in range(params.n)
            ]
        return [
            EngineCoreRequest(
                request_id=rid,
                prompt_token_ids=token_ids,
                sampling_params=p,
                eos_token_id=self.eos_token_id,
                arrival_time=arrival,
                priority=priority,
                lora_request=lora_request,
                cache_salt=cache_salt,
                mm_features=mm_features,
            )
            for rid, p in ids_and_params
        ]


def check_token_ids_in_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Reject token ids outside ``[0, vocab_size)`` in the token-valued sampling fields.

    ``SamplingParams`` alone only knows ids must be non-negative; the vocabulary size comes from the model.
    The front end calls this before a request reaches the engine core, and ``EngineCore.add_request`` calls it
    again for requests that bypass the front end (the worker would otherwise silently drop such ids).

    Raises:
        SamplingParamsError: naming ``logit_bias``, ``allowed_token_ids``, ``stop_token_ids`` or
            ``bad_words_token_ids``, whichever holds the first bad id.
    """
    _check_ids_in_vocab("logit_bias", params.logit_bias or (), vocab_size)
    _check_ids_in_vocab("allowed_token_ids", params.allowed_token_ids or (), vocab_size)
    _check_ids_in_vocab("stop_token_ids", params.stop_token_ids, vocab_size)
    for sequence in params.bad_words_token_ids or ():
        _check_ids_in_vocab("bad_words_token_ids", sequence, vocab_size)


def _check_ids_in_vocab(param: str, token_ids: Iterable[Any], vocab_size: int) -> None:
    for t in token_ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise SamplingParamsError(
                param, f"token id {t!r} is out of vocabulary (valid ids are 0..{vocab_size - 1})"
            )


def _child_seed(seed: int, index: int) -> int:
    """``seed + index``, wrapped into the signed 64-bit range."""
    value = (seed + index) & 0xFFFF_FFFF_FFFF_FFFF
    return value - (1 << 64) if value >= 1 << 63 else value


def _check_encodable(text: str, prompt_param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{prompt_param}: the prompt is not valid Unicode text ({exc.reason} at position {exc.start})",
            param=prompt_param,
        ) from exc
