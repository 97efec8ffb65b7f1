"""Per-request state the model runner keeps between steps, and the batch tensors it builds from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.core.sched_output import NewRequestData
from tokenmill.worker.sampler import SamplingMetadata


@dataclass
class CachedRequestState(NewRequestData):
    """What the worker knows of a request: the fields it arrived with (:class:`NewRequestData`), kept up to
    date step by step (``token_ids`` gains every sampled token, ``block_ids`` new blocks, ``num_computed_tokens``
    the tokens whose KV is in the cache)."""

    # Its per-request logits processors once built (tokenmill.worker.request_logits_processors.RequestProcessors;
    # None: none yet).
    request_processors: Any = None
    # M-RoPE models: the prompt's [3, P] positions and the offset of later tokens (computed on first use)
    mrope_positions: Any = None
    mrope_delta: int = 0

    @classmethod
    def from_new(cls, new: NewRequestData) -> CachedRequestState:
        """The worker's own copy of a scheduled new request (its lists are copied: they grow here)."""
        return cls(new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                   list(new.block_ids), new.num_computed_tokens, new.eos_token_id, new.lora_request,
                   new.pooling_params, new.mm_features)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class BatchInputs:
    """Flattened inputs of one step.

    Attributes:
        input_ids: ``[T]`` int64.
        positions: ``[T]`` int64.
        attn_metadata: for the attention layers.
        logits_indices: ``[B]`` int64, index of each request's last scheduled token in the batch.
        sample_mask: per request, whether this step reaches the end of its known tokens (so it samples).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_mask: list[bool]


def build_batch_inputs(
    states: list[CachedRequestState],
    num_scheduled: list[int],
    block_size: int,
    device: torch.device,
    spec_token_ids: list[list[int]] | None = None,
) -> BatchInputs:
    """Flatten the scheduled tokens of ``states`` (in order) into one batch, without padding.

    ``spec_token_ids`` (speculative decoding): per request, draft tokens that follow its known tokens and are
    part of its scheduled tokens (their KV is written like any other token's).
    """
    num_reqs = len(states)
    starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs)
    counts = np.asarray(num_scheduled, dtype=np.int64)
    seq_lens = starts + counts
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    total = int(query_start_loc[-1])
    # positions: start_r, start_r + 1, ... for each request r
    req_of_token = np.repeat(np.arange(num_reqs), counts)
    positions = np.arange(total, dtype=np.int64) - np.repeat(query_start_loc[:-1], counts) + starts[req_of_token]
    max_blocks = max(len(s.block_ids) for s in states)
    block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    input_ids = np.empty(total, dtype=np.int64)
    for i, s in enumerate(states):
        block_table[i, : len(s.block_ids)] = s.block_ids
        a, b = int(starts[i]), int(seq_lens[i])
        tokens = s.token_ids + spec_token_ids[i] if spec_token_ids and spec_token_ids[i] else s.token_ids
        input_ids[query_start_loc[i] : query_start_loc[i + 1]] = tokens[a:b]
    if max_blocks:
        slot_mapping = (
            block_table[req_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
        )
    else:  # an attention-free model holds no blocks: a negative slot is written nowhere
        slot_mapping = np.full(total, -1, dtype=np.int64)
    md = AttentionMetadata(
        num_actual_tokens=total,
        query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_table=torch.from_numpy(block_table).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        max_query_len=int(counts.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        block_size=block_size,
    )
    return BatchInputs(
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        attn_metadata=md,
        logits_indices=torch.from_numpy(query_start_loc[1:] - 1).to(device),
        sample_mask=[int(seq_lens[i]) >= len(s.token_ids) for i, s in enumerate(states)],
    )


def build_sampling_metadata(states: list[CachedRequestState], vocab_size: int, device: torch.device) -> SamplingMetadata:
    """Collect the sampling settings of ``states`` (one row each) into batched tensors on ``device``.

    Token ids outside ``[0, vocab_size)`` in ``logit_bias``, ``allowed_token_ids`` and bad words are ignored
    here (the engine is expected to reject them up front).
    """
    params = [s.sampling_params for s in states]
    num_rows = len(states)
    temps = [p.temperature for p in params]
    all_greedy = all(p.is_greedy for p in params)
    top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    logprobs = [p.logprobs for p in params if p.logprobs is not None]

    def per_row(values: list[float], off: float) -> torch.Tensor | None:
        if all(v == off for v in values):
            return None
        return torch.tensor(values, dtype=torch.float32, device=device)

    presence = per_row([p.presence_penalty for p in params], 0.0)
    frequency = per_row([p.frequency_penalty for p in params], 0.0)
    repetition = per_row([p.repetition_penalty for p in params], 1.0)
    output_counts = prompt_mask = None
    if presence is not None or frequency is not None or repetition is not None:
        output_counts = token_count_matrix([s.token_ids[s.num_prompt_tokens :] for s in states], vocab_size, device)
    if repetition is not None:
        prompt_counts = token_count_matrix([s.token_ids[: s.num_prompt_tokens] for s in states], vocab_size, device)
        prompt_mask = prompt_counts > 0

    allowed_mask = None
    allowed_rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if allowed_rows:
        rows, cols = [], []
        for i in allowed_rows:
            ids = [t for t in params[i].allowed_token_ids or () if 0 <= t < vocab_size]
            rows += [i] * len(ids)
            cols += ids
        allowed_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        allowed_mask[torch.tensor(allowed_rows, dtype=torch.int64, device=device)] = True
        allowed_mask[_pairs(rows, cols, device)] = False

    banned_rows, banned_cols = [], []
    for i, s in enumerate(states):
        for t in _banned_tokens(s):
            if 0 <= t < vocab_size:
                banned_rows.append(i)
                banned_cols.append(t)

    bias_rows, bias_cols, bias_vals = [], [], []
    for i, p in enumerate(params):
        for t, b in (p.logit_bias or {}).items():
            if 0 <= t < vocab_size:
                bias_rows.append(i)
                bias_cols.append(t)
                bias_vals.append(b)

    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32, device=device),
        all_greedy=all_greedy,
        top_k=None if all(k >= vocab_size for k in top_k) else torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=None if all(p >= 1.0 for p in top_p) else torch.tensor(top_p, dtype=torch.float32, device=device),
        min_p=None if all(p <= 0.0 for p in min_p) else torch.tensor(min_p, dtype=torch.float32, device=device),
        seeds={i: p.seed for i, p in enumerate(params) if p.seed is not None and not p.is_greedy},
        output_positions=[s.num_output_tokens for s in states],
        max_num_logprobs=max(logprobs) if logprobs else None,
        presence_penalties=presence,
        frequency_penalties=frequency,
        repetition_penalties=repetition,
        output_token_counts=output_counts,
        prompt_token_mask=prompt_mask,
        allowed_token_mask=allowed_mask,
        banned_token_indices=torch.stack(_pairs(banned_rows, banned_cols, device)) if banned_rows else None,
        logit_bias_indices=torch.stack(_pairs(bias_rows, bias_cols, device)) if bias_rows else None,
        logit_bias_values=torch.tensor(bias_vals, dtype=torch.float32, device=device) if bias_rows else None,
    )


def token_count_matrix(seqs: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[B, V]`` float32: how often each token occurs in each sequence.

    The sequences are padded into one ``[B, L]`` int64 tensor with the out-of-vocabulary id ``V`` and counted
    with one ``scatter_add_`` into ``[B, V + 1]`` on the device; the padding column is dropped.
    """
    max_len = max((len(s) for s in seqs), default=0)
    padded = np.full((len(seqs), max(max_len, 1)), vocab_size, dtype=np.int64)
    for i, seq in enumerate(seqs):
        padded[i, : len(seq)] = seq
    np.putmask(padded, (padded < 0) | (padded > vocab_size), vocab_size)
    ids = torch.from_numpy(padded).to(device)
    counts = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def _banned_tokens(state: CachedRequestState) -> list[int]:
    """Tokens the next sample of ``state`` must not be (bad words, and stop tokens before ``min_tokens``).

    A bad word ``w`` bans ``w[-1]`` when the output ends with ``w[:-1]`` (a one-token word is always banned).
    """
    p = state.sampling_params
    out: list[int] = []
    num_out = state.num_output_tokens
    if num_out < p.min_tokens:
        out += p.stop_token_ids
        if state.eos_token_id is not None:
            out.append(state.eos_token_id)
    if p.bad_words_token_ids:
        output = state.token_ids[state.num_prompt_tokens :]
        for word in p.bad_words_token_ids:
            prefix = word[:-1]
            if len(prefix) <= num_out and (not prefix or output[num_out - len(prefix) :] == prefix):
                out.append(word[-1])
    return out


def _pairs(rows: list[int], cols: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(cols, dtype=torch.int64, device=device),
    )
