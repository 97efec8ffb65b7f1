"""Per-request state the model runner keeps between steps, and the batch tensors it builds from it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampler import SamplingMetadata


@dataclass
class CachedRequestState:
    """What the worker knows of a request.

    Attributes:
        req_id: the request.
        token_ids: prompt + every output token sampled so far.
        num_prompt_tokens: prompt length.
        sampling_params: its SamplingParams.
        block_ids: its KV blocks in order.
        num_computed_tokens: tokens whose KV is in the cache.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int

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
    states: list[CachedRequestState], num_scheduled: list[int], block_size: int, device: torch.device
) -> BatchInputs:
    """Flatten the scheduled tokens of ``states`` (in order) into one batch, without padding."""
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
        input_ids[query_start_loc[i] : query_start_loc[i + 1]] = s.token_ids[a:b]
    slot_mapping = (
        block_table[req_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    )
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
    """Collect the sampling settings of ``states`` into batched tensors."""
    params = [s.sampling_params for s in states]
    temps = [p.temperature for p in params]
    all_greedy = all(t < 1e-5 for t in temps)
    top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32, device=device),
        all_greedy=all_greedy,
        top_k=None if all(k >= vocab_size for k in top_k) else torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=None if all(p >= 1.0 for p in top_p) else torch.tensor(top_p, dtype=torch.float32, device=device),
        min_p=None if all(p <= 0.0 for p in min_p) else torch.tensor(min_p, dtype=torch.float32, device=device),
        seeds={i: p.seed for i, p in enumerate(params) if p.seed is not None and p.temperature >= 1e-5},
        output_positions=[s.num_output_tokens for s in states],
        max_num_logprobs=max(logprobs) if logprobs else None,
    )
