"""``tokenmill bench latency --speculative-config ... --baseline no-spec`` end to end at tiny shapes (figures
are not checked, only that they exist and add up), and the quote-task prompts."""

from __future__ import annotations

import json
from pathlib import Path

from tests.engine.tiny_model import tiny_llama_with_tokenizer
from tokenmill.entrypoints.cli import main


def test_latency_with_and_without_speculation(tiny_llama_dir: str, tmp_path: Path, capsys) -> None:
    model = tiny_llama_with_tokenizer(tiny_llama_dir, tmp_path / "m")
    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", model, "--dataset-name", "quote", "--input-len", "40",
               "--output-len", "12", "--num-iters", "2", "--num-iters-warmup", "1", "--baseline", "no-spec",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
               "--max-model-len", "400", "--num-gpu-blocks-override", "64", "--block-size", "8",
               "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    spec = r["tokenmill"]["spec_decode"]
    assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] >= 0
    assert spec["num_drafts"] == sum(run["spec"]["num_drafts"] for run in r["tokenmill"]["runs"])
    assert r["baseline"]["identical_outputs"] == "3/3"
    assert r["ratio_decode_tokens_per_s"] > 0 and r["ratio_e2e"] > 0
    assert all(n >= 40 for n in r["engine"]["prompt_lens"])
    printed = capsys.readouterr().out
    assert "Draft acceptance rate" in printed and "tokenmill without speculation" in printed


def test_quote_prompts_are_seeded_and_long_enough() -> None:
    from tests.engine.engine_fakes import byte_level_tokenizer
    from tokenmill.entrypoints.bench.quote_prompts import quote_prompts

    tok = byte_level_tokenizer()
    a = quote_prompts(tok, 3, 200, seed=1)
    assert a == quote_prompts(tok, 3, 200, seed=1) and a != quote_prompts(tok, 3, 200, seed=2)
    assert all(len(p) >= 200 for p in a) and len({tuple(p[:300]) for p in a}) == 3
