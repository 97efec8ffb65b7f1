"""SchedulerOutput: what one engine step computes, as sent from the scheduler to the workers."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenmill.engine.messages import PooledData
from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen (or must rebuild after preemption): sent in full once.

    Attributes:
        req_id: the request.
        token_ids: every known token (prompt, plus outputs so far when resumed after preemption).
        num_prompt_tokens: how many of ``token_ids`` are prompt.
        sampling_params: how to sample.
        block_ids: its KV blocks, in order.
        num_computed_tokens: tokens already in the cache (prefix-cache hits) before this step.
        eos_token_id: the EOS id the sampler masks until ``min_tokens`` (``None``: none, or ``ignore_eos``).
        lora_request: its LoRA adapter (``None``: the base model).
        pooling_params: set for a pooling request (nothing is sampled; its prompt's hidden states are pooled).
        mm_features: its images (placeholder ranges and encoder inputs; ``None`` for a text prompt).
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None
    mm_features: list[MultiModalFeature] | None = None


@dataclass
class CachedRequestData:
    """Deltas for requests the workers already hold, in parallel lists.

    Attributes:
        req_ids: the requests.
        new_block_ids: blocks appended since the last step, per request.
        num_computed_tokens: tokens in the cache before this step, per request.
        new_token_ids: with pipeline parallelism only (else empty): per request, the step's input tokens
            (positions ``num_computed_tokens ..`` of its tokens), so stages that never sample learn the
            tokens the last stage sampled.
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's work.

    Attributes:
        scheduled_new_reqs: requests sent in full.
        scheduled_cached_reqs: deltas for running requests.
        num_scheduled_tokens: tokens to compute this step, per request id.
        total_num_scheduled_tokens: their sum (within ``max_num_batched_tokens``).
        finished_req_ids: requests the workers should forget (finished, aborted or preempted since the last step).
        scheduled_spec_decode_tokens: speculative decoding: per request id, the draft tokens scheduled after its
            known tokens (counted in ``num_scheduled_tokens``); requests without drafts are absent.
        structured_output_request_ids: the constrained requests that sample this step, in the order of the
            rows of ``grammar_bitmask`` (requests in the middle of a prefill are not among them).
        grammar_bitmask: ``[len(structured_output_request_ids), ceil(vocab_size / 32)]`` int32, row ``i`` the
            tokens allowed next for ``structured_output_request_ids[i]`` (bit ``t % 32`` of word ``t // 32``);
            ``None`` when no constrained request samples this step.
        scheduled_encoder_inputs: per request id, the indices of its images (``mm_features``) whose encoder
            runs this step; their outputs stay in the workers' encoder cache, keyed by ``mm_hash``.
        free_encoder_mm_hashes: encoder-cache entries the workers drop before this step's encoding.
        new_state_slots: hybrid models: the state slot of each request in ``scheduled_new_reqs`` (its slot
            until it finishes or is preempted; a resumed request starts from a fresh state).
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    new_state_slots: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """What the model runner returns for one step.

    Attributes:
        req_ids: requests of the step, in batch order.
        sampled_token_ids: per request, the sampled token ids (empty while a prefill is still partial).
        logprobs: per request, ``None`` or per sampled token ``(token_ids, logprobs, sampled_rank)`` where the
            first entry is the sampled token followed by the top-k candidates.
        prompt_logprobs: per request, ``None`` or, once its prefill is complete (with its first sampled
            token), per prompt token from the second on ``(token_ids, logprobs, rank)``: the actual prompt
            token then the top ``prompt_logprobs`` candidates.
        spec_token_ids: speculative decoding: per request, draft tokens proposed for the next step (``None``
            without speculation). With drafts scheduled, ``sampled_token_ids`` holds the accepted drafts then one
            more token (1 to K + 1 tokens).
        pooler_output: per request, the pooled output of a pooling request whose last prompt chunk ran this
            step, else ``None`` (the whole list is ``None`` when the step has no pooling request).
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[tuple[list[int], list[float], int]] | None] | None = None
    prompt_logprobs: list[list[tuple[list[int], list[float], int]] | None] | None = None
    spec_token_ids: list[list[int]] | None = None
    pooler_output: list[PooledData | None] | None = None
