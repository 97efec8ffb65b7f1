"""RejectionSampler: verifies draft tokens against the target model so the output distribution stays exactly
the target's.

Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2): with ``p_j`` the
target's distribution at draft position ``j`` (after every sampling setting of the request: penalties,
temperature, top-k, top-p, min-p, ...) and ``q_j`` the distribution the draft token ``d_j`` was drawn from,

* ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``;
* at the first rejection, the token is drawn from ``norm(max(0, p_j - q_j))`` and the rest is dropped;
* when all K drafts are accepted, a bonus token is drawn from ``p_K``.

Each emitted token is then distributed exactly as the target's own sample at that position.

Deterministic proposers (n-gram lookup, a greedy draft) have a point mass ``q_j = 1[d_j]``. Then the rule is
the same as drawing ``t_j ~ p_j`` with the non-speculative sampler's own noise and accepting ``d_j`` iff
``t_j == d_j`` (accept with probability ``p_j(d_j)``; on rejection ``t_j`` is ``p_j`` conditioned on
``t_j != d_j``, which is ``norm(max(0, p_j - q_j))``). That form is used for them: greedy requests get token
for token the non-speculative output, and seeded requests (noise from ``(seed, output position)``) get the
same tokens as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.sampling_params import SAMPLING_EPS
from tokenmill.worker.sampler import (
    SamplingMetadata,
    _mix_seed,
    exponential_noise,
    gather_logprobs,
    process_logits,
    sampling_probs,
)

LogprobEntry = tuple[list[int], list[float], int]
_UNIFORM_STREAM = 0x2545F4914F6CDD1D  # separates the acceptance uniforms of a seeded row from its sampling noise


@dataclass
class RejectionSamplerOutput:
    """Attributes:
    token_ids: per request, the emitted tokens: the accepted drafts then one more (a replacement for the
        first rejected draft, or the bonus token); 1 to K + 1 tokens.
    num_accepted: per request, accepted drafts.
    logprobs: per request ``None`` or, per emitted token, ``(token_ids, logprobs, rank)`` of the raw
        distribution (the emitted token then the top ``logprobs``); ``None`` when no request asked.
    """

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[LogprobEntry] | None] | None = None


class RejectionSampler:
    def __call__(
        self,
        logits: torch.Tensor,
        md: SamplingMetadata,
        draft_token_ids: list[list[int]],
        draft_probs: list[torch.Tensor | None] | None = None,
        num_logprobs: list[int | None] | None = None,
    ) -> RejectionSamplerOutput:
        """Verify the drafts of ``B`` requests.

        Args:
            logits: ``[R, V]`` target logits, ``R = sum(k_i + 1)``: for request ``i`` with ``k_i`` drafts, the rows
                at its last ``k_i + 1`` positions (the row at offset ``j`` predicts the token after draft
                ``j - 1``; the last is the bonus position).
            md: sampling settings of the ``R`` rows; row ``j`` of a request must see drafts ``0 .. j - 1`` as
                output tokens (penalties, bad words, ``min_tokens``) and output position ``num_output + j``.
            draft_token_ids: ``k_i`` draft ids per request (``k_i`` may be 0).
            draft_probs: per request ``None`` (a point mass on each draft token) or ``[k_i, V]`` float32, the
                distribution each draft token was sampled from.
            num_logprobs: per request, top logprobs wanted (``None``: none).

        Raises:
            ValueError: the row count does not match the drafts.
        """
        num_rows = sum(len(d) + 1 for d in draft_token_ids)
        if logits.shape[0] != num_rows:
            raise ValueError(f"rejection sampler: {logits.shape[0]} logit rows for {num_rows} draft positions")
        logits = logits.float()
        raw = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs is not None else None
        x = process_logits(logits, md) if md.needs_processing else logits
        greedy_tok = x.argmax(dim=-1)
        starts = []
        row = 0
        for d in draft_token_ids:
            starts.append(row)
            row += len(d) + 1

        probs = noise = None
        if md.all_greedy:
            sampled = greedy_tok
        else:
            probs = target_probs(x, md)
            noise = exponential_noise(probs, md)
            sampled = torch.where(md.temperature < SAMPLING_EPS, greedy_tok, (probs / noise).argmax(dim=-1))
        sampled_l = sampled.tolist()
        temps = md.temperature.tolist()

        # requests verified against a real draft distribution (random sampling on both sides)
        prob_reqs = [
            i for i, q in enumerate(draft_probs or [])
            if q is not None and draft_token_ids[i] and temps[starts[i]] >= SAMPLING_EPS
        ]
        accept_l: dict[int, list[bool]] = {}
        resid_l: dict[int, list[int]] = {}
        if prob_reqs:
            assert probs is not None and noise is not None and draft_probs is not None
            rows, toks, qs = [], [], []
            for i in prob_reqs:
                k = len(draft_token_ids[i])
                rows += range(starts[i], starts[i] + k)
                toks += draft_token_ids[i]
                qs.append(draft_probs[i][:k].float())
            rows_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            toks_t = torch.tensor(toks, dtype=torch.int64, device=logits.device)
            q = torch.cat(qs)
            p = probs[rows_t]
            p_d = p.gather(1, toks_t.unsqueeze(1)).squeeze(1)
            q_d = q.gather(1, toks_t.unsqueeze(1)).squeeze(1)
            u = uniform_noise(rows, md, logits.device)
            accepted = u * q_d < p_d  # probability min(1, p / q)
            residual = (p - q).clamp_min(0.0)
            empty = residual.sum(dim=-1, keepdim=True) <= 0
            residual = torch.where(empty, p, residual)  # p == q: never rejected, any distribution will do
            resid_tok = (residual / noise[rows_t]).argmax(dim=-1)
            acc, res = accepted.tolist(), resid_tok.tolist()
            at = 0
            for i in prob_reqs:
                k = len(draft_token_ids[i])
                accept_l[i], resid_l[i] = acc[at : at + k], res[at : at + k]
                at += k

        out_tokens: list[list[int]] = []
        num_accepted: list[int] = []
        for i, drafts in enumerate(draft_token_ids):
            s = starts[i]
            emitted: list[int] = []
            if i in accept_l:
                for j, d in enumerate(drafts):
                    if accept_l[i][j]:
                        emitted.append(d)
                    else:
                        emitted.append(resid_l[i][j])
                        break
                else:
                    emitted.append(sampled_l[s + len(drafts)])
                num_accepted.append(len(emitted) - 1)
            else:
                for j, d in enumerate(drafts):
                    t = sampled_l[s + j]
                    emitted.append(t)
                    if t != d:
                        break
                else:
                    emitted.append(sampled_l[s + len(drafts)])
                num_accepted.append(len(emitted) - 1)
            out_tokens.append(emitted)

        logprobs_out = None
        if raw is not None and num_logprobs is not None:
            chosen = list(sampled_l)
            for i, emitted in enumerate(out_tokens):
                chosen[starts[i] : starts[i] + len(emitted)] = emitted
            ids, lps, ranks = gather_logprobs(
                raw, torch.tensor(chosen, dtype=torch.int64, device=logits.device), md.max_num_logprobs or 0
            )
            ids_l, lps_l, ranks_l = ids.tolist(), lps.tolist(), ranks.tolist()
            logprobs_out = []
            for i, emitted in enumerate(out_tokens):
                want = num_logprobs[i]
                if want is None:
                    logprobs_out.append(None)
                    continue
                s = starts[i]
                logprobs_out.append(
                    [(ids_l[r][: want + 1], lps_l[r][: want + 1], ranks_l[r]) for r in range(s, s + len(emitted))]
                )
        return RejectionSamplerOutput(out_tokens, num_accepted, logprobs_out)


def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """``[R, V]`` float32 sampling distribution of each row, as :class:`tokenmill.worker.sampler.Sampler`
    draws from it (:func:`tokenmill.worker.sampler.sampling_probs`), renormalised after min-p."""
    probs = sampling_probs(logits, md)
    if md.min_p is not None:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def uniform_noise(rows: list[int], md: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """``U(0, 1)`` per listed row (seeded rows from their own stream)."""
    u = torch.rand(len(rows), device=device)
    for at, row in enumerate(rows):
        seed = md.seeds.get(row)
        if seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(_mix_seed(seed ^ _UNIFORM_STREAM, md.output_positions[row]))
            u[at] = torch.rand(1, generator=gen, device=device)[0]
    return u
