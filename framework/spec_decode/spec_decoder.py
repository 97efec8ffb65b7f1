"""SpecDecoder: the model runner's speculative-decoding part (proposing drafts, verifying them).

The model runner calls it at three points of a step: the scheduled drafts go into the flattened batch
(``build_batch_inputs(..., spec_token_ids=...)``), :meth:`SpecDecoder.verify` replaces the sampler for the
step's sampling requests (logits at each draft position and the bonus position, in the same forward pass as
the rest of the batch), and :meth:`SpecDecoder.propose` drafts the next step's tokens from the verified ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram_proposer import NgramProposer
from tokenmill.spec_decode.rejection_sampler import RejectionSampler, RejectionSamplerOutput
from tokenmill.worker.input_batch import CachedRequestState, build_sampling_metadata

# SamplingParams attributes (present in some builds) under which a request is never speculated on: a grammar
# or a custom logits processor decides each token from the ones before it, which the verification pass cannot
# replay for unverified drafts.
_NO_SPEC_FIELDS = ("structured_outputs",)


def supports_speculation(params: SamplingParams) -> bool:
    """Whether a request with ``params`` gets draft tokens (otherwise it decodes one token per step)."""
    return not any(getattr(params, name, None) for name in _NO_SPEC_FIELDS)


class SpecDecoder:
    """Args:
    config: the speculative settings.
    block_size: KV block size.
    device: the worker's device.
    attn_backend: the attention backend class (a draft model's layers use it).
    max_model_len: context length (no draft goes past it).
    kv_cache_dtype: element type of a draft model's KV cache (``None``: the draft's dtype).
    """

    def __init__(
        self, config: SpeculativeConfig, block_size: int, device: torch.device, attn_backend: type, max_model_len: int,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.rejection_sampler = RejectionSampler()
        self.ngram: NgramProposer | None = None
        self.draft = None
        if config.method == "ngram":
            assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
            self.ngram = NgramProposer(self.k, config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            from tokenmill.spec_decode.draft_model import DraftModelProposer

            self.draft = DraftModelProposer(config.draft_model_config, self.k, block_size, device, attn_backend,
                                            kv_cache_dtype)

    # -- model and cache ------------------------------------------------------------------------------

    def load_model(self, process_weights: bool = True) -> None:
        if self.draft is not None:
            self.draft.load_model(process_weights=process_weights)

    def model_memory_bytes(self) -> int:
        return self.draft.model_memory_bytes() if self.draft is not None else 0

    def kv_cache_bytes_per_block(self) -> int:
        return self.draft.kv_cache_bytes_per_block() if self.draft is not None else 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.draft is not None:
            self.draft.initialize_kv_cache(num_blocks)

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        if self.draft is not None:
            self.draft.remove_requests(req_ids)

    # -- one step -------------------------------------------------------------------------------------

    def verify(
        self,
        model: torch.nn.Module,
        hidden: torch.Tensor,
        query_start_loc: list[int],
        states: list[CachedRequestState],
        rows: list[int],
        drafts: list[list[int]],
        vocab_size: int,
        constrain: Callable[[torch.Tensor, list[int], list[CachedRequestState]], torch.Tensor] | None = None,
    ) -> RejectionSamplerOutput:
        """Sample the requests ``rows`` of the batch, verifying their drafts.

        Args:
            model: the target (for ``compute_logits``).
            hidden: ``[T, hidden]`` the target's output for the flattened batch.
            query_start_loc: ``[B + 1]`` offsets of each request's tokens in the batch.
            states: the batch's requests (``token_ids`` = verified tokens only).
            rows: indices of the requests that sample this step.
            drafts: per entry of ``rows``, the scheduled draft ids (at the end of that request's tokens).
            vocab_size: V.
            constrain: ``constrain(logits, rows_of_logits, row_states)`` runs the logits processors and masks
                the rows of structured-output requests (the grammar bitmask) before verification;
                ``rows_of_logits[r]`` is the batch index of logits row ``r`` and ``row_states[r]`` its request
                with the drafts before that position counted as outputs. Constrained requests never have
                drafts, so each has exactly one row.
        """
        device = hidden.device
        hidden_rows: list[int] = []
        expanded: list[CachedRequestState] = []
        draft_probs: list[torch.Tensor | None] = []
        for i, d in zip(rows, drafts):
            k = len(d)
            end = query_start_loc[i + 1]
            hidden_rows.extend(range(end - k - 1, end))
            state = states[i]
            expanded.append(state)
            # row j sees drafts 0 .. j - 1 as outputs: penalties, bad words, min_tokens and seeds follow them
            expanded.extend(dataclasses.replace(state, token_ids=state.token_ids + d[:j]) for j in range(1, k + 1))
            probs = self.draft.take_draft_probs(state.req_id) if self.draft is not None else None
            draft_probs.append(probs if probs is not None and k and probs.shape[0] >= k else None)
        logits = model.compute_logits(hidden[torch.tensor(hidden_rows, device=device)])
        if constrain is not None:
            logits = constrain(logits, [i for i, d in zip(rows, drafts) for _ in range(len(d) + 1)], expanded)
        md = build_sampling_metadata(expanded, vocab_size, device)
        return self.rejection_sampler(
            logits, md, drafts, draft_probs, [states[i].sampling_params.logprobs for i in rows]
        )

    def propose(self, states: list[CachedRequestState]) -> list[list[int]]:
        """Draft tokens after each state's verified tokens (``[]`` for requests that are not speculated on).

        At most K per request, and none past ``max_tokens - 1`` more outputs or ``max_model_len`` (the step that
        verifies them also emits one token of its own).
        """
        limits = []
        for s in states:
            p = s.sampling_params
            room = self.max_model_len - len(s.token_ids) - 1
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - s.num_output_tokens - 1)
            limits.append(max(0, min(self.k, room)) if supports_speculation(p) else 0)
        if self.ngram is not None:
            return [self.ngram.propose(s.token_ids, n) if n > 0 else [] for s, n in zip(states, limits)]
        assert self.draft is not None
        return self.draft.propose(states, limits)
