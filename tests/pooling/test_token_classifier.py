"""A causal LM used as a reranker through its yes/no token logits (Qwen3-Reranker, with vLLM's hf_overrides):
scores equal transformers' softmax over the two token logits at the last position, with tied and untied LM
heads, and the overrides are checked."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model_loader.token_classifier import (
    apply_hf_overrides,
    parse_hf_overrides,
    score_weight_from_lm_head,
    token_classifier_spec,
)

OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
             "is_original_qwen3_reranker": True}
# the prompt layout Qwen3-Reranker's model card gives (system turn, instruction, query, document, empty think)
PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
          'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QUERY = PREFIX + "<Instruct>: Given a web search query, retrieve relevant passages\n<Query>: what is a tokenizer\n"
DOCS = [f"<Document>: {d}{SUFFIX}" for d in ("a tokenizer splits text", "hello world",
                                             "the weather is fine today, tomorrow it will rain")]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def reranker_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Qwen3ForCausalLM whose tokenizer has the tokens "yes" and "no" (as Qwen3-Reranker's has)."""
    from transformers import Qwen3ForCausalLM

    from tests.engine.engine_fakes import byte_level_tokenizer
    from tests.pooling.conftest import _qwen3_config

    path = str(tmp_path_factory.mktemp("qwen3_reranker"))
    torch.manual_seed(7)
    Qwen3ForCausalLM(_qwen3_config(tie_word_embeddings=request.param)).eval().save_pretrained(path)
    tok = byte_level_tokenizer()
    tok.add_tokens(["yes", "no"])
    tok.save_pretrained(path)
    return path


def _hf_yes_probability(model_dir: str, prompts: list[list[int]]) -> list[float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(torch.softmax(model(torch.tensor([p])).logits[0, -1, [no, yes]], dim=-1)[1]) for p in prompts]


def test_qwen3_reranker_scores_equal_transformers_yes_no_softmax(reranker_dir: str) -> None:
    from transformers import AutoTokenizer

    from tokenmill.entrypoints.llm import LLM

    llm = LLM(reranker_dir, dtype="float32", block_size=4, num_gpu_blocks_override=128, hf_overrides=OVERRIDES)
    mc = llm.llm_engine.model_config
    assert (mc.runner_type, mc.convert, mc.hf_config.num_labels) == ("pooling", "classify", 1)
    scores = [o.outputs.score for o in llm.score(QUERY, DOCS)]
    tok = AutoTokenizer.from_pretrained(reranker_dir)
    pairs = [list(tok(QUERY, d)["input_ids"]) for d in DOCS]
    ref = _hf_yes_probability(reranker_dir, pairs)
    assert scores == pytest.approx(ref, abs=1e-5)
    assert sorted(range(3), key=lambda i: -scores[i]) == sorted(range(3), key=lambda i: -ref[i])
    probs = llm.classify([pairs[0]])[0].outputs.probs
    assert probs == pytest.approx([ref[0]], abs=1e-5)


def test_overrides_and_token_classifier_spec() -> None:
    from transformers import Qwen3Config

    cfg = Qwen3Config()
    apply_hf_overrides(cfg, parse_hf_overrides('{"classifier_from_token": ["no", "yes"], '
                                               '"is_original_qwen3_reranker": true, "architectures": ["X"]}'))
    assert cfg.architectures == ["X"] and cfg.num_labels == 1 and token_classifier_spec(cfg)[1] == "from_2_way_softmax"
    per_token = Qwen3Config(classifier_from_token=["a", "b", "c"])
    apply_hf_overrides(per_token, {})
    assert per_token.num_labels == 3 and token_classifier_spec(per_token) == (["a", "b", "c"], "no_post_processing")
    with pytest.raises(ValueError, match="JSON"):
        parse_hf_overrides("{not json")
    with pytest.raises(ValueError, match="two tokens"):
        apply_hf_overrides(Qwen3Config(), {"classifier_from_token": ["a"], "method": "from_2_way_softmax"})
    head = torch.randn(10, 4)
    torch.testing.assert_close(score_weight_from_lm_head(head, [3, 5], "from_2_way_softmax"), (head[5] - head[3])[None])
    torch.testing.assert_close(score_weight_from_lm_head(head, [3, 5], "no_post_processing"), head[[3, 5]])
