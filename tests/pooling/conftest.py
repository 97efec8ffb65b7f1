"""Tiny random pooling checkpoints (saved with save_pretrained, plus a byte-level tokenizer)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.engine.engine_fakes import byte_level_tokenizer

VOCAB = 512
# ChatML, the turn layout of Qwen's chat templates (written here): each message in its own im_start/im_end block
CHATML_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


def _qwen3_config(**overrides):
    from transformers import Qwen3Config

    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def save_sentence_transformers_layout(path: str, pooling: str, normalize: bool = True,
                                      prompts: dict[str, str] | None = None) -> None:
    """modules.json + 1_Pooling/config.json (+ 2_Normalize) as sentence-transformers writes them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    flags = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
             "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
             "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": pooling == "lasttoken",
             "include_prompt": True, "word_embedding_dimension": 64}
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump(flags, f)
    with open(os.path.join(path, "config_sentence_transformers.json"), "w") as f:
        json.dump({"prompts": prompts or {}, "default_prompt_name": None, "similarity_fn_name": "cosine"}, f)
    with open(os.path.join(path, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 512, "do_lower_case": False}, f)


@pytest.fixture(scope="session")
def qwen3_embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Qwen3ForCausalLM checkpoint that ships a sentence-transformers layout with last-token pooling
    (as Qwen3-Embedding does), is Matryoshka-capable, and has a ChatML chat template in its tokenizer."""
    from transformers import Qwen3ForCausalLM

    path = str(tmp_path_factory.mktemp("qwen3_embed"))
    torch.manual_seed(0)
    cfg = _qwen3_config(matryoshka_dimensions=[32, 64])
    Qwen3ForCausalLM(cfg).eval().save_pretrained(path)
    tok = byte_level_tokenizer()
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(path)
    save_sentence_transformers_layout(path, "lasttoken")
    return path


@pytest.fixture(scope="session")
def qwen3_mean_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A bare Qwen3Model checkpoint (no LM head) with mean pooling and no Normalize module."""
    from transformers import Qwen3Model

    path = str(tmp_path_factory.mktemp("qwen3_mean"))
    torch.manual_seed(1)
    Qwen3Model(_qwen3_config()).eval().save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    save_sentence_transformers_layout(path, "mean", normalize=False)
    return path


@pytest.fixture(scope="session")
def qwen3_classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Qwen3ForSequenceClassification with one label (a reranker's shape)."""
    from transformers import Qwen3ForSequenceClassification

    path = str(tmp_path_factory.mktemp("qwen3_cls"))
    torch.manual_seed(2)
    Qwen3ForSequenceClassification(_qwen3_config(num_labels=1)).eval().save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path


def wordpiece_tokenizer():
    """A tiny BERT-style WordPiece tokenizer trained here: ``[CLS] a [SEP] (b [SEP])`` with token type ids."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    from tests.engine.engine_fakes import CORPUS

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(CORPUS * 5, trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials,
                                                                  show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.BertProcessing(("[SEP]", sep), ("[CLS]", cls))
    return BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                             cls_token="[CLS]", mask_token="[MASK]")


def _bert_kwargs(**overrides):
    kwargs = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  max_position_embeddings=128, type_vocab_size=2, pad_token_id=0)
    kwargs.update(overrides)
    return kwargs


@pytest.fixture(scope="session")
def bert_embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A BertModel with a sentence-transformers layout: mean pooling, then Normalize (all-MiniLM's shape)."""
    from transformers import BertConfig, BertModel

    path = str(tmp_path_factory.mktemp("bert_embed"))
    torch.manual_seed(3)
    BertModel(BertConfig(**_bert_kwargs())).eval().save_pretrained(path)
    wordpiece_tokenizer().save_pretrained(path)
    save_sentence_transformers_layout(path, "mean")
    return path


@pytest.fixture(scope="session")
def xlmr_embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An XLMRobertaModel with a sentence-transformers layout: CLS pooling, then Normalize (BGE's shape)."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    path = str(tmp_path_factory.mktemp("xlmr_embed"))
    torch.manual_seed(4)
    cfg = XLMRobertaConfig(**_bert_kwargs(type_vocab_size=1, pad_token_id=1, max_position_embeddings=130))
    XLMRobertaModel(cfg).eval().save_pretrained(path)
    wordpiece_tokenizer().save_pretrained(path)
    save_sentence_transformers_layout(path, "cls")
    return path


@pytest.fixture(scope="session")
def bert_cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A BertForSequenceClassification with one label and two token types (ms-marco cross-encoders' shape)."""
    from transformers import BertConfig, BertForSequenceClassification

    path = str(tmp_path_factory.mktemp("bert_ce"))
    torch.manual_seed(5)
    BertForSequenceClassification(BertConfig(**_bert_kwargs(num_labels=1))).eval().save_pretrained(path)
    wordpiece_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def xlmr_cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An XLMRobertaForSequenceClassification with one label (BGE-reranker's shape)."""
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    path = str(tmp_path_factory.mktemp("xlmr_ce"))
    torch.manual_seed(6)
    cfg = XLMRobertaConfig(**_bert_kwargs(type_vocab_size=1, pad_token_id=1, max_position_embeddings=130,
                                          num_labels=1))
    XLMRobertaForSequenceClassification(cfg).eval().save_pretrained(path)
    wordpiece_tokenizer().save_pretrained(path)
    return path
