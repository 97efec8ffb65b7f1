"""LLM: the offline API (``tokenmill.LLM``): batch generation and chat, and embedding, classification and
scoring with pooling models (docs/pooling.md), in this process."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.output_processor import ERROR_FINISH_REASON
from tokenmill.engine_args import EngineArgs
from tokenmill.errors import EngineGenerateError
from tokenmill.lora.request import LoRARequest
from tokenmill.entrypoints.score_utils import cosine, make_pairs, pair_token_ids
from tokenmill.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

ChatMessage = dict[str, Any]


class LLM:
    """Generate text with a model, offline.

    Args:
        model: a Hugging Face model directory, a hub id, a ``.gguf`` file, or ``None`` for the embedded
            default model.
        **engine_kwargs: any :class:`tokenmill.EngineArgs` field (``max_model_len=2048``, ``dtype="float32"``,
            ``kv_cache_memory="2GiB"``, ...).

    Raises:
        TypeError: an unknown keyword argument (the message lists the valid ones).
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        valid = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(engine_kwargs) - valid)
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {unknown}; valid ones: {sorted(valid - {'model'})}")
        from tokenmill.plugins import load_general_plugins

        load_general_plugins("offline")
        engine_args = EngineArgs(model=model, **engine_kwargs)
        self._init(LLMEngine.from_engine_args(engine_args))

    @classmethod
    def from_llm_engine(cls, llm_engine: LLMEngine) -> LLM:
        """Wrap an existing engine (e.g. one built with a custom EngineCore)."""
        llm = cls.__new__(cls)
        llm._init(llm_engine)
        return llm

    def _init(self, llm_engine: LLMEngine) -> None:
        self.llm_engine = llm_engine
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt; returns one finished RequestOutput per prompt, in order.

        Args:
            prompts: a text, a list of texts, one prompt as token ids (``list[int]``), a list of token-id
                prompts, or ``{"prompt": text}`` / ``{"prompt_token_ids": ids}`` dicts; a ``{"prompt": text}``
                dict may carry vLLM's ``"multi_modal_data": {"image": PIL image or list}`` (the text holds the
                model's image placeholder once per image) and ``"mm_processor_kwargs"`` (docs/multimodal.md).
            sampling_params: one for all prompts, or one per prompt (default: ``SamplingParams()``).
            use_tqdm: show a progress bar over requests.
            priority: one per prompt; lower runs earlier under ``scheduling_policy="priority"`` (ignored by
                ``"fcfs"``). Default: all 0.
            lora_request: the LoRA adapter for every prompt, or one per prompt (``None`` entries: the base
                model); needs ``enable_lora=True``.

        Raises:
            InvalidRequestError: a prompt or parameter is invalid (nothing keeps running); a
                :class:`~tokenmill.lora.LoRALoadError` when an adapter cannot be loaded.
            EngineGenerateError: the engine core failed a request.
            ValueError: ``sampling_params`` or ``priority`` is a list of the wrong length.
        """
        return self._run(_normalize_prompts(prompts), sampling_params, use_tqdm, priority=priority,
                         lora_request=lora_request, mm_inputs=_multimodal_inputs(prompts))

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or a list of them.

        The conversation is rendered with the tokenizer's chat template (or ``chat_template``). Content may be
        OpenAI content parts: ``text``, ``image_url`` (data: URLs; file:// under ``allowed_local_media_path``) and
        ``image_pil`` (a PIL image) for a model that takes images.

        Raises:
            ValueError: no chat template, or both ``add_generation_prompt`` and ``continue_final_message``.
            InvalidRequestError / EngineGenerateError: as :meth:`generate`.
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message=True continues the last message, so add_generation_prompt must be False"
            )
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat: the tokenizer has no chat template; pass chat_template=...")
        from tokenmill.multimodal.chat_parts import render_messages_with_images
        from tokenmill.multimodal.media import MediaConnector

        mm = self.llm_engine.engine_config.multimodal_config
        connector = MediaConnector(mm.allowed_local_media_path, mm.allow_http)
        prompts: list[str | list[int]] = []
        mm_inputs: list[dict[str, Any] | None] = []
        for conversation in conversations:
            rendered, images = render_messages_with_images(conversation, connector)
            prompts.append(
                tokenizer.apply_chat_template(
                    rendered,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template=chat_template,
                )
            )
            mm_inputs.append({"multi_modal_data": {"image": images}} if images else None)
        return self._run(prompts, sampling_params, use_tqdm, add_special_tokens=False, prompt_param="messages",
                         mm_inputs=mm_inputs)

    def encode(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[PoolingRequestOutput]:
        """Run prompts through a pooling model; one PoolingRequestOutput per prompt, in order.

        Raises:
            InvalidRequestError: the model is not served with the pooling runner, or a bad prompt / parameter.
            EngineGenerateError: the engine core failed a request.
        """
        params = pooling_params or PoolingParams()
        return self._run_pooling(_normalize_prompts(prompts), params, use_tqdm, lora_request)

    def embed(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed prompts (one vector each, normalized unless ``normalize=False``; ``dimensions`` shortens
        Matryoshka embeddings). Text prompts get the checkpoint's default sentence-transformers prompt, if any.

        Raises:
            InvalidRequestError: the model does not embed, or a bad prompt / parameter.
        """
        params = (pooling_params or PoolingParams()).with_task("embed")
        normalized = [self._with_default_prompt(p) for p in _normalize_prompts(prompts)]
        return [EmbeddingRequestOutput.from_base(o) for o in self._run_pooling(normalized, params, use_tqdm,
                                                                               lora_request)]

    def classify(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities of each prompt (softmax over the labels, sigmoid for one label).

        Raises:
            InvalidRequestError: the model has no classification head, or a bad prompt / parameter.
        """
        params = (pooling_params or PoolingParams()).with_task("classify")
        return [ClassificationRequestOutput.from_base(o)
                for o in self._run_pooling(_normalize_prompts(prompts), params, use_tqdm, lora_request)]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """Relevance scores of text pairs: ``data_1`` (one text, or N) against ``data_2`` (N texts), as vLLM
        pairs them. A cross-encoder (a classifier with one label) scores each pair in one pass (sigmoid of its
        logit); an embedding model scores the cosine similarity of the two embeddings.

        Raises:
            InvalidRequestError: empty sides, mismatched lengths, or a model that neither embeds nor classifies.
        """
        pairs = make_pairs(data_1, data_2, "data_1", "data_2")
        if self.llm_engine.model_config.convert == "classify":
            tokenizer = self.llm_engine.tokenizer
            params = PoolingParams(task="score", truncate_prompt_tokens=truncate_prompt_tokens)
            outs = self._run_pooling([pair_token_ids(tokenizer, a, b) for a, b in pairs], params, use_tqdm,
                                     lora_request)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data.reshape(-1)[0])),
                                         o.prompt_token_ids) for o in outs]
        texts = sorted({t for pair in pairs for t in pair})
        params = PoolingParams(task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
        embedded = dict(zip(texts, self._run_pooling(list(texts), params, use_tqdm, lora_request)))
        return [
            ScoringRequestOutput(f"{embedded[a].request_id}-{embedded[b].request_id}",
                                 ScoringOutput(cosine(embedded[a].outputs.data, embedded[b].outputs.data)),
                                 embedded[a].prompt_token_ids + embedded[b].prompt_token_ids)
            for a, b in pairs
        ]

    def _with_default_prompt(self, prompt: str | list[int]) -> str | list[int]:
        pooler = self.llm_engine.model_config.pooler_config
        if not isinstance(prompt, str) or pooler is None or not pooler.default_prompt_name:
            return prompt
        return (pooler.prompts or {}).get(pooler.default_prompt_name, "") + prompt

    def _run_pooling(self, prompts: list[str | list[int]], params: PoolingParams, use_tqdm: bool,
                     lora_request: LoRARequest | None) -> list[PoolingRequestOutput]:
        engine = self.llm_engine
        request_ids: list[str] = []
        finished: dict[str, PoolingRequestOutput] = {}
        from tqdm.auto import tqdm

        try:
            for prompt in prompts:
                request_id = str(next(self._request_counter))
                engine.add_request(request_id, prompt, params, lora_request=lora_request, prompt_param="prompts")
                request_ids.append(request_id)
            with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if not isinstance(output, PoolingRequestOutput):
                            failed = [c.stop_reason for c in output.outputs if c.finish_reason == ERROR_FINISH_REASON]
                            raise EngineGenerateError(f"request {output.request_id} failed in the engine core: "
                                                      f"{failed[0] if failed else output.outputs}")
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            engine.abort_request(request_ids)
            raise
        return [finished[i] for i in request_ids]

    def _run(
        self,
        prompts: list[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        *,
        add_special_tokens: bool = True,
        prompt_param: str = "prompt",
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        mm_inputs: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[RequestOutput]:
        priorities = [0] * len(prompts) if priority is None else list(priority)
        mm_list = list(mm_inputs) if mm_inputs is not None else [None] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority: got {len(priorities)} for {len(prompts)} prompts (give one per prompt)")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts (give one, or one per "
                                 "prompt)")
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompts)} prompts (give one, or one per prompt)"
                )
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for prompt, params, prio, lora, mm in zip(prompts, params_list, priorities, loras, mm_list):
                request_id = str(next(self._request_counter))
                engine.add_request(
                    request_id,
                    prompt,
                    msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY),
                    priority=prio,
                    add_special_tokens=add_special_tokens,
                    prompt_param=prompt_param,
                    lora_request=lora,
                    **(mm or {}),
                )
                request_ids.append(request_id)
            finished = self._run_engine(len(request_ids), use_tqdm)
        except BaseException:
            engine.abort_request(request_ids)
            raise
        failed = [
            f"request {o.request_id}: {c.stop_reason}"
            for o in finished.values()
            for c in o.outputs
            if c.finish_reason == ERROR_FINISH_REASON
        ]
        if failed:
            raise EngineGenerateError("the engine core failed requests: " + "; ".join(failed))
        return [finished[i] for i in request_ids if i in finished]

    def _run_engine(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        prompt_tokens = output_tokens = 0
        with tqdm(total=total, desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if not output.finished:
                        continue
                    finished[output.request_id] = output
                    prompt_tokens += len(output.prompt_token_ids)
                    output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(
                        f"input: {prompt_tokens / elapsed:.1f} toks/s, output: {output_tokens / elapsed:.1f} toks/s",
                        refresh=False,
                    )
                    bar.update(1)
        return finished


def _normalize_prompts(prompts: Any) -> list[str | list[int]]:
    if isinstance(prompts, (str, Mapping)):
        prompts = [prompts]
    prompts = list(prompts)
    if prompts and all(_is_token_id(p) for p in prompts):
        return [list(prompts)]
    normalized: list[str | list[int]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise TypeError(f"prompts[{i}]: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            normalized.append(prompt)
        elif isinstance(prompt, Sequence) and all(_is_token_id(t) for t in prompt):
            normalized.append(list(prompt))
        else:
            raise TypeError(f"prompts[{i}]: expected a string or a list of token ids, got {type(prompt).__name__}")
    return normalized


def _multimodal_inputs(prompts: Any) -> list[dict[str, Any] | None] | None:
    """Per prompt, the ``multi_modal_data`` / ``mm_processor_kwargs`` of a dict prompt (``None`` when no prompt
    has any)."""
    if isinstance(prompts, (str, Mapping)):
        prompts = [prompts]
    found: list[dict[str, Any] | None] = []
    for prompt in prompts:
        entry = None
        if isinstance(prompt, Mapping) and (prompt.get("multi_modal_data") or prompt.get("mm_processor_kwargs")):
            entry = {"multi_modal_data": prompt.get("multi_modal_data"),
                     "mm_processor_kwargs": prompt.get("mm_processor_kwargs")}
        found.append(entry)
    return found if any(found) else None


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
