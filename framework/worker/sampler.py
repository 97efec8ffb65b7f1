"""Sampler: batched token selection on the device (no per-request Python loop over the vocabulary).

Order of operations (vLLM V1's):

1. Raw log-probabilities for ``logprobs`` are the ``log_softmax`` of the model's logits, before any processing.
2. Hard restrictions: ``allowed_token_ids`` (every other token -inf), banned tokens (``bad_words`` and, until
   ``min_tokens`` outputs exist, EOS and ``stop_token_ids``) set to -inf.
3. ``logit_bias`` is added.
4. Penalties: repetition (CTRL), then frequency and presence (OpenAI).
5. Greedy rows take the argmax of the processed logits. Random rows divide by the temperature, apply top-k,
   top-p and min-p, and draw one token with the exponential-race trick (``argmax(p / q)``, ``q ~ Exp(1)``),
   which equals sampling from ``p``.

Seeded rows draw their noise from their own generator, re-seeded from ``(seed, output position)`` every step,
so a seeded request's tokens depend neither on the rest of the batch nor on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.sampling_params import SAMPLING_EPS

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of a batch of ``B`` rows over a vocabulary of ``V`` tokens.

    Every optional tensor is ``None`` when no row of the batch uses the feature, so the common case costs
    nothing.

    Attributes:
        temperature: ``[B]`` float32; rows with 0 are greedy.
        all_greedy: every row is greedy (skip the random path).
        top_k: ``[B]`` int64 (vocab size = off), or ``None`` when no row uses it.
        top_p: ``[B]`` float32 (1 = off), or ``None``.
        min_p: ``[B]`` float32 (0 = off), or ``None``.
        seeds: row index -> seed for seeded rows (combined with ``output_positions``).
        output_positions: ``[B]`` list of each row's number of output tokens so far.
        max_num_logprobs: largest ``logprobs`` of a row, or ``None`` when no row wants logprobs.
        presence_penalties: ``[B]`` float32 (0 = off), or ``None``.
        frequency_penalties: ``[B]`` float32 (0 = off), or ``None``.
        repetition_penalties: ``[B]`` float32 (1 = off), or ``None``.
        output_token_counts: ``[B, V]`` float32, occurrences of each token among a row's outputs; set whenever
            a penalty tensor is.
        prompt_token_mask: ``[B, V]`` bool, token occurs in the row's prompt; set with ``repetition_penalties``.
        allowed_token_mask: ``[B, V]`` bool, ``True`` where a token is *not* allowed (rows without
            ``allowed_token_ids`` are all ``False``), or ``None``.
        banned_token_indices: ``[2, N]`` int64 ``(row, token)`` pairs forced to -inf (bad words, min_tokens),
            or ``None``.
        logit_bias_indices: ``[2, M]`` int64 ``(row, token)`` pairs, or ``None``.
        logit_bias_values: ``[M]`` float32 biases added at ``logit_bias_indices``.
    """

    temperature: torch.Tensor
    all_greedy: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    seeds: dict[int, int]
    output_positions: list[int]
    max_num_logprobs: int | None
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    output_token_counts: torch.Tensor | None = None
    prompt_token_mask: torch.Tensor | None = None
    allowed_token_mask: torch.Tensor | None = None
    banned_token_indices: torch.Tensor | None = None
    logit_bias_indices: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None

    @property
    def needs_processing(self) -> bool:
        """Whether any row changes its logits before sampling (other than temperature and truncation)."""
        return any(
            t is not None
            for t in (
                self.presence_penalties,
                self.frequency_penalties,
                self.repetition_penalties,
                self.allowed_token_mask,
                self.banned_token_indices,
                self.logit_bias_indices,
            )
        )


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


def first_max_index(logits: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` -> ``[B]`` int64: the first index of each row's maximum (``argmax``; NaN counts as the maximum,
    as in ``torch.max``).

    Two passes: the maxima of chunks of up to 1,024 columns (a plain reduction), then the first chunk holding the
    row's maximum and the first maximal index within it. torch's CPU ``max(dim)`` / ``argmax`` track an index for
    every element and are several times slower (B=256, V=49,152, float32: 10.4 ms against 1.9 ms;
    docs/benchmarks-history.md, "2026-12-02 Zen 4 (c3bc8e1)"). Rows whose length no power of two from 64 to 1,024
    divides take ``max(dim)``.
    """
    rows, width = logits.shape
    chunk = next((c for c in (1024, 512, 256, 128, 64) if width % c == 0 and width > c), 0)
    if not chunk or rows == 0:
        return logits.max(dim=-1).indices
    blocks = logits.reshape(rows, width // chunk, chunk)
    best = blocks.amax(dim=-1).max(dim=-1).indices  # [B]: the first chunk holding the maximum
    within = blocks[torch.arange(rows, device=logits.device), best].max(dim=-1).indices
    return best * chunk + within


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """``logits``: ``[B, V]`` (any float dtype) -> one token per row."""
        if md.all_greedy and not md.needs_processing and md.max_num_logprobs is None:
            # Widening to float32 is exact, so the maximum of the raw logits is the same token, without a
            # float32 copy of [B, V].
            return SamplerOutput(sampled_token_ids=first_max_index(logits))
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs is not None else None
        if md.needs_processing:
            logits = process_logits(logits, md)
        greedy = first_max_index(logits)
        if md.all_greedy:
            sampled = greedy
        else:
            sampled = self._sample(logits, md, greedy)
        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs or 0, out)
        return out

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata, greedy: torch.Tensor) -> torch.Tensor:
        probs = sampling_probs(logits, md)
        sampled = (probs / exponential_noise(probs, md)).argmax(dim=-1)
        return torch.where(md.temperature < SAMPLING_EPS, greedy, sampled)

    @staticmethod
    def _gather_logprobs(raw: torch.Tensor, sampled: torch.Tensor, k: int, out: SamplerOutput) -> None:
        ids, lps, ranks = gather_logprobs(raw, sampled, k)
        out.logprob_token_ids, out.logprobs, out.sampled_ranks = ids, lps, ranks


def sampling_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """``[R, V]`` float32 weights the sampler draws each row from: processed ``logits`` / temperature, then
    top-k, top-p, softmax and min-p. Rows sum to 1 except after min-p (the exponential race needs no
    normalisation; the rejection sampler renormalises)."""
    x = logits / md.temperature.clamp(min=SAMPLING_EPS).unsqueeze(1)
    if md.top_k is not None:
        x = apply_top_k(x, md.top_k)
    if md.top_p is not None:
        x = apply_top_p(x, md.top_p)
    probs = torch.softmax(x, dim=-1)
    if md.min_p is not None:
        probs = apply_min_p(probs, md.min_p)
    return probs


def exponential_noise(probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """``Exp(1)`` noise of the exponential race (``argmax(p / noise)`` samples from ``p``), shaped like ``probs``;
    a seeded row draws from its own generator seeded by ``(seed, output position)``, so a seeded request's
    tokens do not depend on the batch it runs in."""
    q = torch.empty_like(probs).exponential_()
    for row, seed in md.seeds.items():
        gen = torch.Generator(device=probs.device)
        gen.manual_seed(_mix_seed(seed, md.output_positions[row]))
        q[row].exponential_(generator=gen)
    return q


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logprob and 1-based rank of ``token_ids`` plus each row's top ``k``.

    Args:
        logprobs: ``[N, V]`` float32 log-probabilities.
        token_ids: ``[N]`` int64, the token of interest per row (sampled, or the actual next prompt token).
        k: number of top candidates (0: none).

    Returns:
        ``ids [N, 1 + k]`` int64 (``token_ids`` first), ``lps [N, 1 + k]`` float32, ``ranks [N]`` int64 where
        rank 1 is the most likely token (ties share the better rank).
    """
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        return torch.cat([token_ids.unsqueeze(1), top_ids], dim=1), torch.cat([chosen, top_lp], dim=1), ranks
    return token_ids.unsqueeze(1), chosen, ranks


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Apply allowed tokens, banned tokens, logit bias and penalties to ``[B, V]`` float32 logits (new tensor)."""
    if md.allowed_token_mask is not None:
        logits = logits.masked_fill(md.allowed_token_mask, _NEG_INF)
    else:
        logits = logits.clone()
    if md.banned_token_indices is not None:
        rows, cols = md.banned_token_indices
        logits[rows, cols] = _NEG_INF
    if md.logit_bias_indices is not None:
        rows, cols = md.logit_bias_indices
        assert md.logit_bias_values is not None
        logits.index_put_((rows, cols), md.logit_bias_values, accumulate=True)
    return apply_penalties(
        logits,
        md.output_token_counts,
        md.prompt_token_mask,
        md.presence_penalties,
        md.frequency_penalties,
        md.repetition_penalties,
    )


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor | None,
    prompt_mask: torch.Tensor | None,
    presence: torch.Tensor | None,
    frequency: torch.Tensor | None,
    repetition: torch.Tensor | None,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties on ``[B, V]`` float32 logits.

    - Repetition (CTRL, Keskar et al. 2019, as in vLLM and transformers): for tokens seen in the prompt or the
      output, ``l / r`` when ``l > 0`` else ``l * r``; ``repetition`` is ``[B]``, 1 = off.
    - Frequency and presence (OpenAI API reference, "Parameter details"):
      ``l - c * frequency - (c > 0) * presence`` with ``c`` the token's count in the output so far.

    Args:
        output_counts: ``[B, V]`` float32 counts of output tokens (required with any penalty).
        prompt_mask: ``[B, V]`` bool, token in prompt (required with ``repetition``).
        presence, frequency, repetition: ``[B]`` float32 or ``None``.
    """
    if presence is None and frequency is None and repetition is None:
        return logits
    assert output_counts is not None
    in_output = output_counts > 0
    if repetition is not None:
        assert prompt_mask is not None
        rep = repetition.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(in_output | prompt_mask, penalised, logits)
    if frequency is not None:
        logits = logits - frequency.unsqueeze(1) * output_counts
    if presence is not None:
        logits = logits - presence.unsqueeze(1) * in_output.to(logits.dtype)
    return logits


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities below ``min_p[row]`` times the row's largest (Nguyen et al. 2024); ``[B, V]``."""
    top = probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < min_p.unsqueeze(1) * top, 0.0)


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
