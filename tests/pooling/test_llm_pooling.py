"""Pooling models through the whole engine: embeddings, classification and scores equal transformers', with
chunked prefill splitting prompts over several steps, mixed with generation, and no KV blocks left behind."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.errors import InvalidRequestError
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

# mixed lengths; with a budget of 16 tokens per step the long ones run over several steps
PROMPTS = [list(range(5, 8)), list(range(10, 27)), [(7 * i) % 500 + 3 for i in range(41)], list(range(30, 60))]
ENGINE = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=256)


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def _assert_no_leaked_blocks(llm) -> None:
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks, "KV blocks leaked after all requests finished"


def _hf_hidden(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


@pytest.fixture(scope="module")
def embedder(qwen3_embedder_dir):
    from tokenmill.entrypoints.llm import LLM

    return LLM(qwen3_embedder_dir, **ENGINE)


def test_runner_and_pooler_come_from_the_sentence_transformers_files(embedder):
    mc = embedder.llm_engine.model_config
    assert (mc.runner_type, mc.convert, mc.pooler_config.pooling_type) == ("pooling", "embed", "LAST")
    assert mc.pooler_config.normalize is True


def test_last_token_embeddings_match_transformers_across_chunks(embedder, qwen3_embedder_dir):
    outs = embedder.embed(PROMPTS)
    refs = [F.normalize(h[-1], dim=-1) for h in _hf_hidden(qwen3_embedder_dir, PROMPTS)]
    for out, ref, prompt in zip(outs, refs, PROMPTS):
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == (64,)
        assert float(F.cosine_similarity(got, ref, dim=0)) > 1 - 1e-5, f"prompt of {len(prompt)} tokens"
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
        assert out.prompt_token_ids == prompt
    _assert_no_leaked_blocks(embedder)


def test_matryoshka_dimensions_and_normalize(embedder, qwen3_embedder_dir):
    ref = _hf_hidden(qwen3_embedder_dir, PROMPTS[:1])[0][-1]
    short = embedder.embed(PROMPTS[:1], PoolingParams(dimensions=32))[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(short), F.normalize(ref[:32], dim=-1), atol=1e-5, rtol=1e-4)
    raw = embedder.embed(PROMPTS[:1], PoolingParams(normalize=False))[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(raw), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(InvalidRequestError, match="dimensions"):
        embedder.embed(PROMPTS[:1], PoolingParams(dimensions=48))
    with pytest.raises(InvalidRequestError, match="task"):
        embedder.classify(PROMPTS[:1])


def test_too_long_inputs_are_refused_unless_truncated(embedder, qwen3_embedder_dir):
    too_long = [3 + i % 400 for i in range(513)]
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        embedder.embed([too_long])
    out = embedder.embed([too_long], PoolingParams(truncate_prompt_tokens=20))[0]
    assert out.prompt_token_ids == too_long[-20:]
    ref = F.normalize(_hf_hidden(qwen3_embedder_dir, [too_long[-20:]])[0][-1], dim=-1)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=1e-4)


def test_embeddings_mixed_with_generation_leave_no_blocks(embedder, qwen3_embedder_dir):
    engine = embedder.llm_engine
    for i, prompt in enumerate(PROMPTS * 3):
        if i % 2:
            engine.add_request(f"g{i}", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        else:
            engine.add_request(f"e{i}", prompt, PoolingParams(task="embed"))
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    assert len(results) == len(PROMPTS) * 3
    refs = [F.normalize(h[-1], dim=-1) for h in _hf_hidden(qwen3_embedder_dir, PROMPTS)]
    for i, prompt in enumerate(PROMPTS * 3):
        out = results[f"g{i}" if i % 2 else f"e{i}"]
        if i % 2:
            assert len(out.outputs[0].token_ids) == 6
        else:
            torch.testing.assert_close(out.outputs.data, refs[i % len(PROMPTS)], atol=1e-5, rtol=1e-4)
    _assert_no_leaked_blocks(embedder)


def test_embedding_on_a_generate_runner_names_the_runner(qwen3_embedder_dir):
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(qwen3_embedder_dir, runner="generate", **ENGINE)
    with pytest.raises(InvalidRequestError, match="'generate' runner"):
        llm.embed(PROMPTS[:1])
    assert llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2), use_tqdm=False)


def test_mean_pooling_without_normalize(qwen3_mean_model_dir):
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(qwen3_mean_model_dir, **ENGINE)
    mc = llm.llm_engine.model_config
    assert (mc.pooler_config.pooling_type, mc.pooler_config.normalize) == ("MEAN", False)
    outs = llm.embed(PROMPTS)
    for out, hidden in zip(outs, _hf_hidden(qwen3_mean_model_dir, PROMPTS)):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), hidden.mean(0), atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=32))
    with pytest.raises(InvalidRequestError, match="cannot generate"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_no_leaked_blocks(llm)


def test_generate_runner_is_refused_for_a_pooling_only_architecture(qwen3_mean_model_dir):
    from tokenmill.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="runner"):
        LLM(qwen3_mean_model_dir, runner="generate", **ENGINE)


def test_classifier_scores_and_rerank_order_match_transformers(qwen3_classifier_dir):
    from transformers import AutoTokenizer, Qwen3ForSequenceClassification

    from tokenmill.entrypoints.llm import LLM

    llm = LLM(qwen3_classifier_dir, **ENGINE)
    assert llm.llm_engine.model_config.convert == "classify"
    hf = Qwen3ForSequenceClassification.from_pretrained(qwen3_classifier_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [torch.sigmoid(hf(torch.tensor([p])).logits[0]) for p in PROMPTS]
    for out, r in zip(llm.classify(PROMPTS), ref):
        torch.testing.assert_close(torch.tensor(out.outputs.probs), r, atol=1e-5, rtol=1e-4)
    tok = AutoTokenizer.from_pretrained(qwen3_classifier_dir)
    query = "what is a tokenizer"
    docs = ["a tokenizer splits text", "the weather is fine", "tokens come out of a tokenizer", "hello"]
    scores = [o.outputs.score for o in llm.score(query, docs)]
    with torch.no_grad():
        ref_scores = [float(torch.sigmoid(hf(torch.tensor([tok(query, d)["input_ids"]])).logits[0, 0]))
                      for d in docs]
    assert scores == pytest.approx(ref_scores, abs=1e-5)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    assert order == sorted(range(len(docs)), key=lambda i: -ref_scores[i])
    _assert_no_leaked_blocks(llm)
