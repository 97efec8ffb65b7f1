"""Sampler unit tests: logits processing against per-row reference formulas, truncation masks, logprobs."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.input_batch import CachedRequestState, build_sampling_metadata, token_count_matrix
from tokenmill.worker.sampler import (
    Sampler,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    process_logits,
)

V = 12
CPU = torch.device("cpu")


def state(prompt: list[int], output: list[int] = (), eos: int | None = None, **kw) -> CachedRequestState:
    kw.setdefault("temperature", 0.0)
    params = SamplingParams(**kw)
    return CachedRequestState(
        req_id="r",
        token_ids=list(prompt) + list(output),
        num_prompt_tokens=len(prompt),
        sampling_params=params,
        block_ids=[],
        num_computed_tokens=0,
        eos_token_id=eos,
    )


def reference_penalties(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """Straight per-token transcription of the formulas (CTRL repetition penalty, OpenAI frequency/presence)."""
    out = []
    for tok, value in enumerate(logits):
        count = output.count(tok)
        if tok in prompt or tok in output:
            value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        value -= count * p.frequency_penalty
        value -= (1.0 if count > 0 else 0.0) * p.presence_penalty
        out.append(value)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_match_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, V, generator=gen) * 3
    rows = [
        ([1, 2, 3, 3], [4, 4, 5, 1], dict(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3)),
        ([7, 8], [8, 8, 8], dict(frequency_penalty=-0.7)),
        ([0, 11], [], dict(repetition_penalty=0.6, presence_penalty=-1.5)),
        ([5, 6], [9, 10], {}),  # no penalties: unchanged
    ]
    states = [state(p, o, **kw) for p, o, kw in rows]
    md = build_sampling_metadata(states, V, CPU)
    got = process_logits(logits, md)
    for r, (p, o, _) in enumerate(rows):
        ref = reference_penalties(logits[r].tolist(), p, o, states[r].sampling_params)
        assert got[r].tolist() == pytest.approx(ref, abs=1e-5)
    assert torch.equal(got[3], logits[3])


def test_token_count_matrix():
    counts = token_count_matrix([[1, 1, 3], [], [0, 11, 11, 11]], V, CPU)
    assert counts.shape == (3, V)
    assert counts[0, 1] == 2 and counts[0, 3] == 1 and counts[0].sum() == 3
    assert counts[1].sum() == 0
    assert counts[2, 11] == 3 and counts[2, 0] == 1


def test_logit_bias_is_added_and_clamped():
    params = SamplingParams(temperature=0, logit_bias={3: 5.0, "4": 1000, 5: -1000})
    assert params.logit_bias == {3: 5.0, 4: 100.0, 5: -100.0}
    s = state([1], logit_bias={3: 5.0, 4: 1000})
    logits = torch.zeros(1, V)
    got = process_logits(logits, build_sampling_metadata([s], V, CPU))
    expected = torch.zeros(V)
    expected[3], expected[4] = 5.0, 100.0
    assert torch.equal(got[0], expected)
    assert Sampler()(logits, build_sampling_metadata([s], V, CPU)).sampled_token_ids.item() == 4


def test_allowed_token_ids_only_allowed_sampled():
    allowed = [2, 7, 9]
    states = [state([1], temperature=1.0, allowed_token_ids=allowed), state([1])]
    md = build_sampling_metadata(states, V, CPU)
    logits = torch.randn(2, V)
    got = process_logits(logits, md)
    assert torch.isinf(got[0]).sum() == V - 3 and torch.isfinite(got[0, allowed]).all()
    assert torch.equal(got[1], logits[1])  # row without the option untouched
    torch.manual_seed(0)
    seen = {Sampler()(torch.randn(2, V) * 5, md).sampled_token_ids[0].item() for _ in range(50)}
    assert seen <= set(allowed) and len(seen) > 1


def test_bad_words_ban_last_token_after_matching_prefix():
    words = [[3], [6, 7], [5, 8], [1, 6, 9], [4, 5, 6, 10]]
    s = state([1, 2], [4, 5, 6], bad_words_token_ids=words)
    got = process_logits(torch.zeros(1, V), build_sampling_metadata([s], V, CPU))[0]
    banned = {t for t in range(V) if got[t] == -math.inf}
    # [3]: always; [6,7]: output ends with 6; [5,8]: no (ends with 6); [1,6,9]: no ([5,6] != [1,6]);
    # [4,5,6,10]: whole output matches the prefix
    assert banned == {3, 7, 10}
    fresh = state([6], [], bad_words_token_ids=words)  # the prefix must match the output, not the prompt
    got = process_logits(torch.zeros(1, V), build_sampling_metadata([fresh], V, CPU))[0]
    assert {t for t in range(V) if got[t] == -math.inf} == {3}


@pytest.mark.parametrize("num_out,banned", [(0, True), (2, True), (3, False)])
def test_min_tokens_masks_eos_and_stop_ids(num_out, banned):
    s = state([1], [5] * num_out, eos=2, min_tokens=3, stop_token_ids=[9], max_tokens=10)
    logits = torch.zeros(1, V)
    logits[0, 2] = logits[0, 9] = 10.0
    md = build_sampling_metadata([s], V, CPU)
    got = process_logits(logits, md) if md.needs_processing else logits
    assert (got[0, 2] == -math.inf) == banned and (got[0, 9] == -math.inf) == banned
    token = Sampler()(logits, md).sampled_token_ids.item()
    assert (token not in (2, 9)) == banned
    # ignore_eos: the scheduler sends eos_token_id=None, so only stop ids are masked
    s2 = state([1], [], eos=None, min_tokens=3, stop_token_ids=[9], max_tokens=10)
    got = process_logits(logits, build_sampling_metadata([s2], V, CPU))
    assert got[0, 2] == 10.0 and got[0, 9] == -math.inf


def test_top_k_mask():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 5.0, 3.0, 4.0, 2.0]])
    got = apply_top_k(logits, torch.tensor([2, 5]))
    assert torch.isfinite(got[0]).tolist() == [False, True, False, True, False]
    assert torch.equal(got[1], logits[1])


def test_top_p_mask():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().repeat(3, 1)
    got = apply_top_p(logits, torch.tensor([0.75, 0.85, 1e-3]))
    assert torch.isfinite(got[0]).tolist() == [False, True, False, True]  # 0.5 + 0.3 >= 0.75
    assert torch.isfinite(got[1]).tolist() == [False, True, True, True]  # needs 0.15 too
    assert torch.isfinite(got[2]).tolist() == [False, True, False, False]  # top token always kept


def test_min_p_mask():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.05, 0.5, 0.15, 0.3]])
    got = apply_min_p(probs, torch.tensor([0.2, 0.0]))
    assert (got[0] > 0).tolist() == [False, True, True, True]  # threshold 0.2 * 0.5 = 0.1
    assert torch.equal(got[1], probs[1])


def test_greedy_rows_unchanged_in_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    states = [
        state([1]),
        state([1, 2], [3, 3], temperature=0.9, top_k=3, top_p=0.8, min_p=0.1, presence_penalty=1.0,
              repetition_penalty=1.5, logit_bias={0: 50.0}, seed=3),
        state([4]),
        state([1], temperature=1.3, allowed_token_ids=[1, 2], bad_words_token_ids=[[5]], logprobs=3),
    ]
    out = Sampler()(logits, build_sampling_metadata(states, V, CPU))
    assert out.sampled_token_ids[0] == logits[0].argmax() and out.sampled_token_ids[2] == logits[2].argmax()
    assert out.sampled_token_ids[1] == 0  # the +50 bias dominates
    assert out.sampled_token_ids[3].item() in (1, 2)


def test_greedy_with_penalty_uses_processed_logits():
    logits = torch.zeros(1, V)
    logits[0, 4] = 1.0
    logits[0, 6] = 0.9
    s = state([1], [4], frequency_penalty=0.5)
    assert Sampler()(logits, build_sampling_metadata([s], V, CPU)).sampled_token_ids.item() == 6


def test_logprobs_are_raw_and_ranks_one_based():
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    states = [state([1], [2], logprobs=4, repetition_penalty=2.0, logit_bias={3: 30.0}), state([1], logprobs=0)]
    out = Sampler()(logits, build_sampling_metadata(states, V, CPU))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprob_token_ids.shape == (2, 5)
    assert out.sampled_token_ids[0] == 3
    for r in range(2):
        ids = out.logprob_token_ids[r]
        assert ids[0] == out.sampled_token_ids[r]
        assert torch.allclose(out.logprobs[r], raw[r, ids])
        assert ids[1:].tolist() == raw[r].topk(4).indices.tolist()
        expected_rank = int((raw[r] > raw[r, ids[0]]).sum()) + 1
        assert out.sampled_ranks[r] == expected_rank
    assert out.sampled_ranks[1] == 1  # greedy without processing: the top token


def test_seeded_row_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    seeded = state([1], [4, 5], temperature=1.0, seed=1234)
    alone = Sampler()(logits[1:2], build_sampling_metadata([seeded], V, CPU)).sampled_token_ids.item()
    for _ in range(3):
        others = [state([1], temperature=1.0), seeded, state([2], temperature=0.7, seed=99)]
        batched = Sampler()(logits, build_sampling_metadata(others, V, CPU)).sampled_token_ids[1].item()
        assert batched == alone


def test_new_params_validate_and_serialise():
    p = SamplingParams(logit_bias={1: 2.0}, allowed_token_ids=[1, 2], bad_words=["x"], bad_words_token_ids=[[1, 2]])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams()), type=SamplingParams) == SamplingParams()
    bad = [
        ("logit_bias", dict(logit_bias={"a": 1.0})),
        ("logit_bias", dict(logit_bias={1: "x"})),
        ("logit_bias", dict(logit_bias={-3: 1.0})),
        ("allowed_token_ids", dict(allowed_token_ids=[])),
        ("allowed_token_ids", dict(allowed_token_ids=[1, -1])),
        ("bad_words", dict(bad_words=[1])),
        ("bad_words_token_ids", dict(bad_words_token_ids=[[]])),
        ("bad_words_token_ids", dict(bad_words_token_ids=[[1, 2.5]])),
        ("presence_penalty", dict(presence_penalty=2.5)),
        ("min_tokens", dict(min_tokens=5, max_tokens=2)),
    ]
    for field, kwargs in bad:
        with pytest.raises(ValueError) as e:
            SamplingParams(**kwargs)
        assert str(e.value).startswith(field), (field, e.value)


def test_top_k_larger_than_vocab_mixed_with_small_top_k():
    V = 16
    states = [state([1, 2], top_k=1000, temperature=1.0), state([3], top_k=2, temperature=1.0)]
    md = build_sampling_metadata(states, V, CPU)
    logits = torch.arange(V, dtype=torch.float32).repeat(2, 1)
    out = Sampler()(logits, md).sampled_token_ids
    assert 0 <= out[0].item() < V
    assert out[1].item() in (V - 1, V - 2)


def test_plain_greedy_batch_takes_argmax_of_low_precision_logits_directly():
    torch.manual_seed(0)
    logits = torch.randn(6, V).bfloat16()
    logits[2, 3] = logits[2, 7] = logits[2].max() + 1  # a tie: the first index wins, as in float32
    md = build_sampling_metadata([state([1]) for _ in range(6)], V, CPU)
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=-1)) and out.sampled_token_ids[2] == 3
    assert out.logprobs is None
    # Asking for logprobs keeps the float32 path (and its figures).
    with_lp = Sampler()(logits, build_sampling_metadata([state([1], logprobs=2) for _ in range(6)], V, CPU))
    assert torch.equal(with_lp.sampled_token_ids, out.sampled_token_ids) and with_lp.logprobs.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("width", [49152, 32000, 151936, 1000, 64, 7])
def test_first_max_index_is_the_first_argmax(dtype, width):
    from tokenmill.worker.sampler import first_max_index

    g = torch.Generator().manual_seed(width)
    logits = torch.randn(9, width, generator=g).to(dtype)
    logits[1, width // 3] = logits[1, width - 1] = 50  # ties: the first wins
    logits[2] = -float("inf")  # nothing allowed: index 0, as torch.max
    logits[3, width // 2] = float("nan")  # NaN counts as the maximum
    logits[4, 0] = logits[4, width // 2] = float("nan")
    got = first_max_index(logits)
    assert got.dtype == torch.int64 and got.shape == (9,)
    assert torch.equal(got, logits.max(dim=-1).indices)
    assert got[1] == width // 3 and got[2] == 0 and got[3] == width // 2 and got[4] == 0
    assert torch.equal(first_max_index(logits[:0]), logits[:0].max(dim=-1).indices)
