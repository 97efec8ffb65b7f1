"""Logprobs, prompt logprobs, seeded sampling and logits processors end to end on the tiny Llama."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_llama_correctness import step_until_idle, tokens
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.engine_args import EngineArgs
from tokenmill.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 33, 44, 100], list(range(20, 47)), [3, 4], [7] * 13]


@pytest.fixture(scope="module")
def core(tiny_llama_dir) -> EngineCore:
    # block_size 4 and a 16-token budget: long prompts are prefilled in several chunks
    args = EngineArgs(
        model=tiny_llama_dir, dtype="float32", block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=128
    )
    return EngineCore(args.create_engine_config())


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def run(core: EngineCore, reqs: dict[str, tuple[list[int], SamplingParams]], eos: int | None = None):
    return step_until_idle(core, [EngineCoreRequest(rid, prompt, params, eos_token_id=eos)
                                  for rid, (prompt, params) in reqs.items()])


def check_entry(entry, token: int, ref_row: torch.Tensor, k: int) -> None:
    """One ``(token_ids, logprobs, rank)`` entry against transformers' log_softmax row ``[V]``."""
    ids, lps, rank = entry
    assert ids[0] == token and len(ids) == len(lps) == k + 1
    assert lps == pytest.approx(ref_row[ids].tolist(), abs=1e-4)
    assert ids[1:] == ref_row.topk(k).indices.tolist()
    assert rank == int((ref_row > ref_row[token]).sum()) + 1


def test_logprobs_and_prompt_logprobs_match_transformers(core, hf_model):
    k, pk = 5, 3
    reqs = {
        f"lp{i}": (p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=k, prompt_logprobs=pk))
        for i, p in enumerate(PROMPTS)
    }
    outs = run(core, reqs)
    # Again with the prompts' blocks now in the prefix cache: prompt logprobs must still cover every token.
    again = run(core, {f"again{i}": v for i, v in enumerate(reqs.values())})
    for i, prompt in enumerate(PROMPTS):
        for res in (outs[f"lp{i}"], again[f"again{i}"]):
            gen = tokens(res)
            assert len(gen) == 6
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt + gen])).logits[0]
            ref = torch.log_softmax(logits.float(), dim=-1)
            assert gen == ref[len(prompt) - 1 : -1].argmax(-1).tolist()
            entries = [e for o in res for e in o.new_logprobs]
            assert len(entries) == 6
            for j, entry in enumerate(entries):
                check_entry(entry, gen[j], ref[len(prompt) - 1 + j], k)
            assert res[0].prompt_logprobs is not None
            assert all(o.prompt_logprobs is None for o in res[1:])
            assert len(res[0].prompt_logprobs) == len(prompt) - 1
            for t, entry in enumerate(res[0].prompt_logprobs):
                check_entry(entry, prompt[t + 1], ref[t], pk)


def test_seeded_request_same_tokens_whatever_the_batch(core):
    seeded = (PROMPTS[0], SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=10, ignore_eos=True))
    alone = tokens(run(core, {"s": seeded})["s"])
    others = {
        "a": (PROMPTS[1], SamplingParams(temperature=1.2, max_tokens=12, ignore_eos=True)),
        "b": (PROMPTS[3], SamplingParams(temperature=0, max_tokens=4, presence_penalty=1.0, ignore_eos=True)),
        "c": (PROMPTS[2], SamplingParams(temperature=0.8, seed=7, top_k=20, max_tokens=8, ignore_eos=True)),
    }
    batched = run(core, {**others, "s": seeded})
    assert tokens(batched["s"]) == alone
    reseeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1, max_tokens=10, ignore_eos=True)
    other_seed = tokens(run(core, {"s": (seeded[0], reseeded)})["s"])
    assert other_seed != alone


def test_min_tokens_bad_words_and_allowed_ids_end_to_end(core):
    prompt = PROMPTS[0]
    greedy = tokens(run(core, {"g": (prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))})["g"])
    # Treat the first greedy token as EOS: min_tokens must hold it off for 3 tokens.
    eos = greedy[0]
    out = run(core, {"m": (prompt, SamplingParams(temperature=0, max_tokens=8, min_tokens=3))}, eos=eos)["m"]
    gen = tokens(out)
    assert eos not in gen[:3] and len(gen) >= 3
    # Banning the first greedy token as a one-token bad word changes the first output.
    no_first = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, bad_words_token_ids=[[greedy[0]]])
    banned = tokens(run(core, {"b": (prompt, no_first)})["b"])
    assert banned[0] != greedy[0] and greedy[0] not in banned
    allowed = [10, 11, 12]
    only = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed)
    sampled = tokens(run(core, {"a": (prompt, only)})["a"])
    assert set(sampled) <= set(allowed)


def test_prompt_logprobs_survive_preemption(core, tiny_llama_dir):
    """A tight cache preempts requests mid-prefill and mid-decode; each still gets its prompt logprobs once."""
    args = EngineArgs(
        model=tiny_llama_dir, dtype="float32", block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=14
    )
    tight = EngineCore(args.create_engine_config())
    preemptions = 0
    original = tight.scheduler._preempt

    def counting(req):
        nonlocal preemptions
        preemptions += 1
        original(req)

    tight.scheduler._preempt = counting
    reqs = {
        f"p{i}": (p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2))
        for i, p in enumerate(PROMPTS)
    }
    got = run(tight, reqs)
    expected = run(core, {f"x{i}": v for i, v in enumerate(reqs.values())})
    assert preemptions > 0
    for i, prompt in enumerate(PROMPTS):
        res, ref = got[f"p{i}"], expected[f"x{i}"]
        assert tokens(res) == tokens(ref)
        assert [o.prompt_logprobs is not None for o in res] == [True] + [False] * (len(res) - 1)
        assert len(res[0].prompt_logprobs) == len(prompt) - 1
        for (ids, lps, rank), (rids, rlps, rrank) in zip(res[0].prompt_logprobs, ref[0].prompt_logprobs):
            assert ids == rids and rank == rrank and lps == pytest.approx(rlps, abs=1e-4)
