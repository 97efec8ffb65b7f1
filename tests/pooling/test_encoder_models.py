"""Encoder-only models (bidirectional attention): BERT / XLM-RoBERTa embedders equal sentence-transformers'
``encode``, cross-encoder scores and rerank order equal transformers', and backends without encoder support
refuse such layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

TEXTS = ["a tokenizer splits text into tokens", "hello", "the weather is fine today and tomorrow, they say",
         "tokens come out of a tokenizer, one after another, until the text ends", "short text"]
QUERY = "what does a tokenizer do"
ENGINE = dict(dtype="float32", block_size=4, num_gpu_blocks_override=256)


def _assert_no_leaked_blocks(llm) -> None:
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks


@pytest.mark.parametrize("fixture", ["bert_embedder_dir", "xlmr_embedder_dir"])
def test_embeddings_equal_sentence_transformers(fixture, request):
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer

    from tokenmill.entrypoints.llm import LLM

    model_dir = request.getfixturevalue(fixture)
    llm = LLM(model_dir, **ENGINE)
    assert llm.llm_engine.model_config.runner_type == "pooling"
    assert llm.llm_engine.engine_config.cache_config.enable_prefix_caching is False
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    ref = SentenceTransformer(model_dir, device="cpu").encode(TEXTS, convert_to_tensor=True).float()
    cos = F.cosine_similarity(got, ref, dim=-1)
    assert torch.all(cos > 1 - 1e-5), cos
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    _assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("fixture", ["bert_cross_encoder_dir", "xlmr_cross_encoder_dir"])
def test_cross_encoder_scores_and_rerank_order_equal_transformers(fixture, request):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tokenmill.entrypoints.llm import LLM

    model_dir = request.getfixturevalue(fixture)
    llm = LLM(model_dir, **ENGINE)
    assert llm.llm_engine.model_config.convert == "classify"
    scores = [o.outputs.score for o in llm.score(QUERY, TEXTS)]
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = []
        for t in TEXTS:
            inputs = tok(QUERY, t, return_tensors="pt")
            if hf.config.type_vocab_size == 1:  # RoBERTa's tokenizers give no second segment
                inputs.pop("token_type_ids", None)
            ref.append(float(torch.sigmoid(hf(**inputs).logits[0, 0])))
    assert scores == pytest.approx(ref, abs=1e-5)
    assert sorted(range(len(TEXTS)), key=lambda i: -scores[i]) == sorted(range(len(TEXTS)), key=lambda i: -ref[i])
    _assert_no_leaked_blocks(llm)


def test_encoder_models_refuse_generation_and_small_step_budgets(bert_embedder_dir):
    from tokenmill.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="runner"):
        LLM(bert_embedder_dir, runner="generate", **ENGINE)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(bert_embedder_dir, max_num_batched_tokens=16, **ENGINE)


def test_a_backend_without_encoder_support_refuses_encoder_layers():
    from tokenmill.attention.backends.torch_paged import TorchPagedAttentionBackend
    from tokenmill.attention.selector import get_attn_backend, set_attn_backend
    from tokenmill.layers import Attention

    class DecoderOnlyBackend(TorchPagedAttentionBackend):
        name = "DECODER_ONLY"
        supports_encoder_only = False

    previous = get_attn_backend()
    set_attn_backend(DecoderOnlyBackend)
    try:
        with pytest.raises(ValueError, match="encoder-only"):
            Attention(4, 16, 0.25, 4, prefix="enc", attn_type="encoder_only")
        Attention(4, 16, 0.25, 4, prefix="dec")
    finally:
        set_attn_backend(previous)


def test_encoder_attention_matches_bidirectional_reference():
    """forward_encoder over a batch of whole sequences equals dense non-causal attention per sequence."""
    from tokenmill.attention.backends.torch_paged import TorchPagedAttentionImpl
    from tokenmill.worker.input_batch import CachedRequestState, build_batch_inputs
    from tokenmill.sampling_params import SamplingParams

    torch.manual_seed(0)
    impl = TorchPagedAttentionImpl(4, 8, 8**-0.5, 2)
    lens = [3, 7, 1]
    states = [CachedRequestState(str(i), list(range(n)), n, SamplingParams(), [i], 0) for i, n in enumerate(lens)]
    md = build_batch_inputs(states, lens, 16, torch.device("cpu")).attn_metadata
    total = sum(lens)
    q, k, v = torch.randn(total, 32, dtype=torch.float64), torch.randn(total, 16, dtype=torch.float64), \
        torch.randn(total, 16, dtype=torch.float64)
    out = impl.forward_encoder(q, k, v, md)
    start = 0
    for n in lens:
        qs = q[start:start + n].view(n, 4, 8).transpose(0, 1)
        ks = k[start:start + n].view(n, 2, 8).transpose(0, 1).repeat_interleave(2, dim=0)
        vs = v[start:start + n].view(n, 2, 8).transpose(0, 1).repeat_interleave(2, dim=0)
        probs = torch.softmax(qs @ ks.transpose(1, 2) * 8**-0.5, dim=-1)
        ref = (probs @ vs).transpose(0, 1).reshape(n, 32)
        torch.testing.assert_close(out[start:start + n], ref)
        start += n


def test_encoder_models_allocate_no_kv_cache(bert_embedder_dir):
    """Encoder layers never read or write the paged cache: no cache memory is allocated, the blocks only count
    the tokens of a step (``max_num_batched_tokens`` / block size + ``max_num_seqs``), and embeddings still
    come out with every block returned."""
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(bert_embedder_dir, dtype="float32", block_size=4, max_num_seqs=8)
    core = llm.llm_engine.engine_core.engine_core
    assert core.executor.worker.model_runner.kv_caches == []
    sc = llm.llm_engine.engine_config.scheduler_config
    assert llm.llm_engine.engine_config.cache_config.num_gpu_blocks == -(-sc.max_num_batched_tokens // 4) + 8
    outs = llm.embed(TEXTS * 4)
    assert len(outs) == len(TEXTS) * 4 and all(len(o.outputs.embedding) > 0 for o in outs)
    _assert_no_leaked_blocks(llm)
