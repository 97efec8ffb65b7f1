"""``tokenmill bench embed`` runs end to end on a tiny BERT embedder with the sentence-transformers baseline
(figures are not checked, only that they exist, add up, and that both sides computed the same embeddings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.entrypoints.bench.embed import word_texts
from tokenmill.entrypoints.cli import main


def test_word_texts_have_the_exact_length(bert_embedder_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bert_embedder_dir)
    texts = word_texts(tok, 4, 12, seed=1)
    assert [len(tok(t)["input_ids"]) for t in texts] == [12] * 4
    assert texts == word_texts(tok, 4, 12, seed=1) and texts != word_texts(tok, 4, 12, seed=2)
    with pytest.raises(ValueError, match="special tokens"):
        word_texts(tok, 1, 2, seed=1)


def test_bench_embed_with_sentence_transformers_baseline(bert_embedder_dir: str, tmp_path: Path) -> None:
    pytest.importorskip("sentence_transformers")
    out = tmp_path / "embed.json"
    rc = main(["bench", "embed", "--model", bert_embedder_dir, "--num-prompts", "3", "--input-len", "8,16",
               "--num-iters", "2", "--num-iters-warmup", "0", "--baseline", "sentence-transformers",
               "--st-dtypes", "float32", "--json", str(out), "--num-gpu-blocks-override", "64",
               "--block-size", "4", "--dtype", "float32"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "embed" and "bench embed" in r["command"] and r["dtype"] == "float32"
    assert set(r["lengths"]) == {"8", "16"}
    for fig in r["lengths"].values():
        tm, base = fig["tokenmill"], fig["baseline"]
        assert len(tm["times_s"]) == 2 and tm["sequences_per_s"] == pytest.approx(3 / tm["median_s"])
        assert base["best_dtype"] == "float32" and len(base["dtypes"]["float32"]["times_s"]) == 2
        assert fig["ratio_sequences_per_s"] == pytest.approx(tm["sequences_per_s"] / base["sequences_per_s"])
        assert fig["ratio_same_dtype"] == fig["ratio_sequences_per_s"]  # one dtype on both sides
        assert fig["min_cosine_vs_baseline_float32"] > 1 - 1e-5
    assert r["baseline"]["name"] == "sentence-transformers"


def test_bench_embed_refuses_a_generation_model(qwen3_embedder_dir: str) -> None:
    with pytest.raises(SystemExit, match="generate runner"):
        main(["bench", "embed", "--model", qwen3_embedder_dir, "--runner", "generate", "--num-prompts", "1",
              "--input-len", "8", "--num-gpu-blocks-override", "16", "--block-size", "4", "--max-model-len", "64"])


def test_the_same_dtype_ratio_is_against_the_baseline_in_tokenmills_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """With several baseline dtypes, ``ratio_same_dtype`` compares with the one tokenmill ran in, not the last."""
    import argparse
    import types

    import numpy as np

    from tokenmill.entrypoints.bench import embed

    class FakeLLM:
        def embed(self, texts):
            return [types.SimpleNamespace(outputs=types.SimpleNamespace(embedding=[1.0, 0.0])) for _ in texts]

    class FakeST:
        def to(self, dtype):
            pass

        def encode(self, texts):
            return np.array([[1.0, 0.0]] * len(texts))

    args = argparse.Namespace(num_iters=2, num_iters_warmup=0)
    for dtype, ratio in (("float32", 2.0), ("bfloat16", 4.0)):
        times = iter([1.0, 2.0, 4.0] * 2)  # per iteration: tokenmill, float32 baseline, bfloat16 baseline (s)
        monkeypatch.setattr(embed, "_timed", lambda fn: next(times))
        fig = embed._measure_length(args, FakeLLM(), FakeST(), ["float32", "bfloat16"], ["a", "b"], dtype)
        assert fig["baseline"]["best_dtype"] == "float32" and fig["ratio_sequences_per_s"] == pytest.approx(2.0)
        assert fig["ratio_same_dtype"] == pytest.approx(ratio)
