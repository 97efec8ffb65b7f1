"""Random sampling with a draft model: the tokens' distribution is the non-speculative engine's.

600 seeded requests (temperature 1) on a 16-token model; each generates 3 tokens, so its second step verifies
one draft drawn from the draft model (accepted about half the time: both the accept and the residual paths
are exercised). The marginal distributions of the 2nd and 3rd tokens are compared with those of the engine
without speculation (total-variation distance). Every row is seeded, so the test is deterministic; the
tolerance is ~2.5x the distance measured, and an implementation that accepts every draft (no min(1, p/q)
test) lands at ~8x it.
"""

from __future__ import annotations

import collections

import pytest
import torch

from tests.spec_decode.engine_utils import make_core, run
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode import rejection_sampler as rs_module

N = 600
TOLERANCE = 0.12


def tv_per_position(a: dict[str, list[int]], b: dict[str, list[int]]) -> list[float]:
    out = []
    for pos in (1, 2):
        ca = collections.Counter(t[pos] for t in a.values())
        cb = collections.Counter(t[pos] for t in b.values())
        out.append(0.5 * sum(abs(ca[k] - cb[k]) for k in set(ca) | set(cb)) / N)
    return out


@pytest.mark.slow
def test_draft_model_sampling_matches_the_target_distribution(peaked_pair, monkeypatch) -> None:
    target, draft = peaked_pair
    requests = [(f"r{i}", [3, 4, 5, 6], SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True))
                for i in range(N)]
    engine_kw = dict(max_num_seqs=256, num_gpu_blocks_override=2000)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    plain = run(make_core(target, **engine_kw), requests).tokens
    res = run(make_core(target, spec, **engine_kw), requests)
    assert 0.25 < res.spec.acceptance_rate < 0.75  # both paths of the rejection sampler ran
    assert max(tv_per_position(plain, res.tokens)) < TOLERANCE

    monkeypatch.setattr(rs_module, "uniform_noise", lambda rows, md, device: torch.zeros(len(rows)))
    wrong = run(make_core(target, spec, **engine_kw), requests).tokens
    assert max(tv_per_position(plain, wrong)) > 2 * TOLERANCE
