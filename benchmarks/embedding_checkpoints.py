"""Write random-weight embedding checkpoints at real models' shapes for ``tokenmill bench embed`` (no downloads).

Each is a transformers ``BertModel`` saved with ``save_pretrained`` plus a sentence-transformers layout
(``modules.json``, ``1_Pooling/config.json``, ``2_Normalize``), so both tokenmill and
``sentence_transformers.SentenceTransformer`` load it as they would the real model:

- ``bge-base``: BAAI/bge-base-en-v1.5's shape (hidden 768, 12 layers, 12 heads, MLP 3072, 512 positions,
  CLS pooling, normalized);
- ``minilm-l6``: sentence-transformers/all-MiniLM-L6-v2's shape (hidden 384, 6 layers, 12 heads, MLP 1536,
  512 positions, mean pooling, normalized).

The tokenizer is a WordPiece tokenizer (``BertTokenizerFast``) over a made-up vocabulary of the real size
(30522 entries: the five BERT special tokens and random lowercase words), so every word of a benchmark text is
one token. Weights are random (seeded): the figures are about speed, not quality.

    python benchmarks/embedding_checkpoints.py /tmp/embed-models          # writes /tmp/embed-models/{bge-base,minilm-l6}
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "bge-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
                 "pooling": "cls"},
    "minilm-l6": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536,
                  "pooling": "mean"},
}
VOCAB_SIZE = 30522
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def random_vocab(size: int, seed: int = 0) -> list[str]:
    """BERT's special tokens followed by ``size - 5`` distinct random lowercase words (3 to 9 letters)."""
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < size - len(SPECIAL_TOKENS):
        words.add("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))))
    return [*SPECIAL_TOKENS, *sorted(words)]


def save_tokenizer(path: str, vocab: list[str]) -> None:
    """A lower-casing ``BertTokenizerFast`` over ``vocab`` (``[CLS] a [SEP]`` framing, 512 tokens at most)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    tok = Tokenizer(models.WordPiece(vocab={word: i for i, word in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", vocab.index("[SEP]")), ("[CLS]", vocab.index("[CLS]")))
    BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                      cls_token="[CLS]", mask_token="[MASK]", model_max_length=512).save_pretrained(path)


def save_sentence_transformers_files(path: str, pooling: str, hidden_size: int) -> None:
    """``modules.json`` (Transformer, Pooling, Normalize) and the pooling module's config, as
    sentence-transformers writes them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    for sub in ("1_Pooling", "2_Normalize"):
        os.makedirs(os.path.join(path, sub), exist_ok=True)
    files: dict[str, Any] = {
        "modules.json": modules,
        "1_Pooling/config.json": {
            "word_embedding_dimension": hidden_size, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": False, "include_prompt": True},
        "sentence_bert_config.json": {"max_seq_length": 512, "do_lower_case": False},
        "config_sentence_transformers.json": {"prompts": {}, "default_prompt_name": None,
                                              "similarity_fn_name": "cosine"},
    }
    for name, content in files.items():
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)


def write_checkpoint(path: str, shape: str, seed: int = 0) -> str:
    """Write the ``shape`` checkpoint (a key of :data:`SHAPES`) to ``path``; returns ``path``."""
    import torch
    from transformers import BertConfig, BertModel

    spec = dict(SHAPES[shape])
    pooling = spec.pop("pooling")
    os.makedirs(path, exist_ok=True)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0, **spec)
    BertModel(config).eval().save_pretrained(path)
    save_tokenizer(path, random_vocab(VOCAB_SIZE, seed))
    save_sentence_transformers_files(path, pooling, spec["hidden_size"])
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="Folder to write one sub-folder per shape into.")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"Comma-separated shapes (default {','.join(SHAPES)}).")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        print(write_checkpoint(os.path.join(args.out_dir, shape), shape.strip(), args.seed))


if __name__ == "__main__":
    main()
