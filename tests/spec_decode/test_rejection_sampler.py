"""RejectionSampler: the emitted tokens are distributed exactly as the target's samples (seeded statistics with
a tolerance that a wrong implementation fails), greedy verification is an equality test, and point-mass
drafts reuse the non-speculative sampler's noise (same seed, same tokens)."""

from __future__ import annotations

import collections

import pytest
import torch

from tokenmill.spec_decode import rejection_sampler as rs_module
from tokenmill.spec_decode.rejection_sampler import RejectionSampler
from tokenmill.worker.sampler import Sampler, SamplingMetadata

V = 6
N = 20_000  # requests verified in one call (each its own rows)
# TV distance of an empirical distribution over 6 outcomes from the truth is ~0.01 at this N; a
# wrong sampler that always accepts the draft lands at TV(p, q) = 0.4 below.
TOLERANCE = 0.03


def metadata(num_rows: int, temperature: float = 1.0, seeds: dict[int, int] | None = None,
             positions: list[int] | None = None, max_num_logprobs: int | None = None) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((num_rows,), temperature),
        all_greedy=temperature == 0.0,
        top_k=None, top_p=None, min_p=None,
        seeds=seeds or {},
        output_positions=positions or [0] * num_rows,
        max_num_logprobs=max_num_logprobs,
    )


P0 = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])  # target at draft position 0
P1 = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])  # target at position 1 (after draft 0)
P2 = torch.tensor([0.30, 0.30, 0.10, 0.10, 0.10, 0.10])  # bonus position
Q0 = torch.tensor([0.05, 0.05, 0.10, 0.20, 0.30, 0.30])  # draft distributions, far from the target
Q1 = torch.tensor([0.30, 0.30, 0.20, 0.10, 0.05, 0.05])


def tv(counts: collections.Counter, probs: torch.Tensor) -> float:
    total = sum(counts.values())
    return 0.5 * sum(abs(counts.get(t, 0) / total - float(probs[t])) for t in range(V))


def run_two_drafts(sampler: RejectionSampler, seed: int = 0) -> list[list[int]]:
    """``N`` requests with 2 drafts each drawn from (Q0, Q1); target (P0, P1, P2)."""
    gen = torch.Generator().manual_seed(seed)
    d0 = torch.multinomial(Q0, N, replacement=True, generator=gen).tolist()
    d1 = torch.multinomial(Q1, N, replacement=True, generator=gen).tolist()
    logits = torch.stack([P0.log(), P1.log(), P2.log()]).repeat(N, 1)
    probs = [torch.stack([Q0, Q1])] * N
    torch.manual_seed(seed)
    out = sampler(logits, metadata(3 * N), [[a, b] for a, b in zip(d0, d1)], probs)
    return out.token_ids


def check_distribution(tokens: list[list[int]]) -> tuple[float, float, float]:
    first = collections.Counter(t[0] for t in tokens)
    # the second token exists when the first draft was accepted; it must then follow the target at position 1
    second = collections.Counter(t[1] for t in tokens if len(t) >= 2)
    third = collections.Counter(t[2] for t in tokens if len(t) == 3)
    return tv(first, P0), tv(second, P1), tv(third, P2)


def test_emitted_tokens_follow_the_target_distribution() -> None:
    tokens = run_two_drafts(RejectionSampler())
    assert all(1 <= len(t) <= 3 for t in tokens)
    tv0, tv1, tv2 = check_distribution(tokens)
    assert tv0 < TOLERANCE and tv1 < TOLERANCE and tv2 < TOLERANCE, (tv0, tv1, tv2)
    # acceptance of draft 0 is sum_t min(p, q) (Leviathan et al. 2023, section 3.3)
    expected = float(torch.minimum(P0, Q0).sum())
    accepted = sum(len(t) >= 2 for t in tokens) / N
    assert accepted == pytest.approx(expected, abs=0.02)


def test_the_check_catches_a_sampler_that_skips_the_p_over_q_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tolerance is tight enough: accepting every draft (no min(1, p/q) test) fails it."""
    monkeypatch.setattr(rs_module, "uniform_noise", lambda rows, md, device: torch.zeros(len(rows)))
    tv0, _, _ = check_distribution(run_two_drafts(RejectionSampler()))
    assert tv0 > 5 * TOLERANCE


def test_point_mass_drafts_keep_the_target_distribution() -> None:
    """n-gram drafts (no draft distribution): draft 0 is always token 4, a token the target rarely picks."""
    logits = torch.stack([P0.log(), P1.log()]).repeat(N, 1)
    torch.manual_seed(1)
    out = RejectionSampler()(logits, metadata(2 * N), [[4]] * N)
    first = collections.Counter(t[0] for t in out.token_ids)
    assert tv(first, P0) < TOLERANCE
    accepted = sum(len(t) == 2 for t in out.token_ids) / N
    assert accepted == pytest.approx(float(P0[4]), abs=0.01)
    assert tv(collections.Counter(t[1] for t in out.token_ids if len(t) == 2), P1) < 3 * TOLERANCE


def test_greedy_accepts_the_argmax_chain_and_stops_at_the_first_miss() -> None:
    rows = torch.tensor([[0.0, 5, 1, 0, 0, 0], [0, 0, 0, 7, 0, 0], [9, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 3]])
    sampler = RejectionSampler()
    out = sampler(rows, metadata(4, temperature=0.0), [[1, 3, 0]])
    assert out.token_ids == [[1, 3, 0, 5]] and out.num_accepted == [3]
    out = sampler(rows, metadata(4, temperature=0.0), [[1, 2, 0]])
    assert out.token_ids == [[1, 3]] and out.num_accepted == [1]
    out = sampler(rows[:1], metadata(1, temperature=0.0), [[]])
    assert out.token_ids == [[1]] and out.num_accepted == [0]


def test_seeded_point_mass_verification_matches_the_plain_sampler() -> None:
    """The token at each position is the one the non-speculative sampler draws for that (seed, position)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seeds = {0: 1234, 1: 1234, 2: 1234}
    plain = [int(Sampler()(logits[j : j + 1], metadata(1, seeds={0: 1234}, positions=[7 + j])).sampled_token_ids[0])
             for j in range(3)]
    out = RejectionSampler()(logits, metadata(3, seeds=seeds, positions=[7, 8, 9]), [[plain[0], plain[1]]])
    assert out.token_ids == [plain]
    wrong = (plain[0] + 1) % 50
    out = RejectionSampler()(logits, metadata(3, seeds=seeds, positions=[7, 8, 9]), [[wrong, plain[1]]])
    assert out.token_ids == [[plain[0]]]


def test_logprobs_are_of_the_emitted_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    out = RejectionSampler()(logits, metadata(3, temperature=0.0, max_num_logprobs=2),
                             [[int(logits[0].argmax()), (int(logits[1].argmax()) + 1) % V]], num_logprobs=[2])
    assert out.token_ids[0] == [int(logits[0].argmax()), int(logits[1].argmax())]
    lps = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and len(out.logprobs[0]) == 2
    for j, (ids, values, rank) in enumerate(out.logprobs[0]):
        assert ids[0] == out.token_ids[0][j] and rank == 1 and len(ids) == 3
        assert values[0] == pytest.approx(float(lps[j, ids[0]]), abs=1e-5)


def test_row_count_must_match_the_drafts() -> None:
    with pytest.raises(ValueError, match="logit rows"):
        RejectionSampler()(torch.zeros(2, V), metadata(2), [[1, 2]])
