"""Sampler: batched token selection on the device (no per-request Python loop over the vocabulary).

Order of operations (vLLM's): raw log-probabilities for ``logprobs`` are taken from the model's logits before
any processing; then temperature, top-k, top-p and min-p restrict the distribution and one token per row is
drawn with the exponential-race trick (``argmax(p / q)``, ``q ~ Exp(1)``), which equals sampling from ``p``.
Seeded rows draw their noise from their own generator, re-seeded from ``(seed, output position)`` every step,
so a seeded request's tokens depend neither on the rest of the batch nor on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of a batch of ``B`` rows.

    Attributes:
        temperature: ``[B]`` float32; rows with 0 are greedy.
        all_greedy: every row is greedy (skip the random path).
        top_k: ``[B]`` int64 (vocab size = off), or ``None`` when no row uses it.
        top_p: ``[B]`` float32 (1 = off), or ``None``.
        min_p: ``[B]`` float32 (0 = off), or ``None``.
        seeds: row index -> seed for seeded rows (combined with ``output_positions``).
        output_positions: ``[B]`` list of each row's number of output tokens so far.
        max_num_logprobs: largest ``logprobs`` of a row, or ``None`` when no row wants logprobs.
    """

    temperature: torch.Tensor
    all_greedy: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    seeds: dict[int, int]
    output_positions: list[int]
    max_num_logprobs: int | None


@dataclass
class SamplerOutput:
    """Attributes:
    sampled_token_ids: ``[B]`` int64.
    logprob_token_ids: ``[B, 1 + k]`` int64: the sampled token then the top-k tokens (``None`` if not asked).
    logprobs: ``[B, 1 + k]`` float32 log-probabilities of those tokens.
    sampled_ranks: ``[B]`` int64, 1-based rank of the sampled token.
    """

    sampled_token_ids: torch.Tensor
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """``logits``: ``[B, V]`` float32 -> one token per row."""
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs is not None else None
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            sampled = greedy
        else:
            sampled = self._sample(logits, md, greedy)
        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs or 0, out)
        return out

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata, greedy: torch.Tensor) -> torch.Tensor:
        temp = md.temperature.clamp(min=1e-5).unsqueeze(1)
        x = logits / temp
        if md.top_k is not None:
            x = apply_top_k(x, md.top_k)
        if md.top_p is not None:
            x = apply_top_p(x, md.top_p)
        probs = torch.softmax(x, dim=-1)
        if md.min_p is not None:
            top = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < md.min_p.unsqueeze(1) * top, 0.0)
        q = torch.empty_like(probs).exponential_()
        for row, seed in md.seeds.items():
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(_mix_seed(seed, md.output_positions[row]))
            q[row].exponential_(generator=gen)
        sampled = (probs / q).argmax(dim=-1)
        return torch.where(md.temperature < 1e-5, greedy, sampled)

    @staticmethod
    def _gather_logprobs(raw: torch.Tensor, sampled: torch.Tensor, k: int, out: SamplerOutput) -> None:
        sampled_lp = raw.gather(1, sampled.unsqueeze(1))
        ranks = (raw > sampled_lp).sum(dim=-1) + 1
        if k > 0:
            top_lp, top_ids = raw.topk(k, dim=-1)
            out.logprob_token_ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
            out.logprobs = torch.cat([sampled_lp, top_lp], dim=1)
        else:
            out.logprob_token_ids = sampled.unsqueeze(1)
            out.logprobs = sampled_lp
        out.sampled_ranks = ranks


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k[row]`` largest logits (ties at the threshold kept); ``[B, V]``."""
    max_k = int(top_k.max().item())
    kth = logits.topk(max_k, dim=-1).values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al. 2019): keep the smallest set of most likely tokens whose probability
    reaches ``top_p[row]``; the most likely token is always kept."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    mask = torch.zeros_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, _NEG_INF)


def _mix_seed(seed: int, position: int) -> int:
    """A 63-bit seed from the request's seed and the output position (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
