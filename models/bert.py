"""BERT and XLM-RoBERTa encoders (BGE, E5, all-MiniLM, multilingual E5, BGE-M3's dense vectors) and their
sequence-classification heads (cross-encoder rerankers such as BGE-reranker), as transformers defines them:
embeddings (word + position + token type, LayerNorm), post-LayerNorm layers with bidirectional attention and a
GELU MLP. Parameter names mirror transformers' so checkpoints load as they are. These models run on one rank.

Token types: the engine feeds token ids and positions only; a pair input (``[CLS] a [SEP] b [SEP]``, the
tokenizer's pair encoding) has token type 1 after its first ``[SEP]``, which is how BERT's tokenizer sets
``token_type_ids``, so the model derives them from the ids when its config has more than one token type.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.layers import Attention, QKVParallelLinear, ReplicatedLinear


def _activation(name: str) -> nn.Module:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: Any, position_offset: int = 0) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        # XLM-RoBERTa numbers positions from padding_idx + 1
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
             + self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        # query, key and value as one product (checkpoint names map onto it in _load_by_name), through the
        # platform's linear method like every decoder's projections
        self.qkv = QKVParallelLinear(cfg.hidden_size, self.head_dim, self.num_heads, self.num_heads, bias=True)
        self.hidden_size = cfg.hidden_size
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads, prefix=f"{prefix}.attn",
                              attn_type="encoder_only")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.hidden_size, dim=-1)
        return self.attn(q, k, v)


class BertDenseOutput(nn.Module):
    """``LayerNorm(dense(x) + residual)`` (transformers' ``BertSelfOutput`` / ``BertOutput``)."""

    def __init__(self, in_features: int, cfg: Any) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(in_features, cfg.hidden_size, bias=True)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # the product is a fresh tensor: the residual goes into it in place (no third [T, hidden] buffer)
        return self.LayerNorm(self.dense(x).add_(residual))


class BertAttention(nn.Module):
    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg, f"{prefix}.self")
        self.output = BertDenseOutput(cfg.hidden_size, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.act = _activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, f"{prefix}.attention")
        self.intermediate = BertIntermediate(cfg)
        self.output = BertDenseOutput(cfg.intermediate_size, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, f"{prefix}.layer.{i}") for i in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


class BertModel(nn.Module):
    """The encoder: ``input_ids``, ``positions`` ``[T]`` int64 -> last hidden states ``[T, hidden]``.

    Args:
        config: the engine's ModelConfig (``hf_config`` a transformers BertConfig or XLMRobertaConfig).
    """

    has_lm_head: ClassVar[bool] = False
    position_offset_from_padding: ClassVar[bool] = False  # XLM-RoBERTa
    checkpoint_prefix: ClassVar[str] = ""  # what the classification checkpoints put before the encoder's names

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        cfg = config.hf_config
        self.config = cfg
        offset = int(cfg.pad_token_id) + 1 if self.position_offset_from_padding else 0
        self.embeddings = BertEmbeddings(cfg, offset)
        self.encoder = BertEncoder(cfg, f"{prefix}encoder")
        self.sep_token_id = _sep_token_id(config) if int(cfg.type_vocab_size) > 1 else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None
                ) -> torch.Tensor:
        token_types = _token_type_ids(input_ids, positions, self.sep_token_id)
        return self.encoder(self.embeddings(input_ids, positions, token_types))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} is an encoder: it has no LM head and cannot generate")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load transformers-named tensors (an encoder checkpoint, or one with a ``bert.`` / ``roberta.`` prefix);
        the unused pooler and LM-head tensors are skipped.

        Raises:
            KeyError: a tensor matches no parameter.
        """
        return _load_by_name(self, weights, self.checkpoint_prefix, skip=("pooler.", "embeddings.position_ids"))


class XLMRobertaModel(BertModel):
    position_offset_from_padding = True


class BertForSequenceClassification(nn.Module):
    """transformers' BertForSequenceClassification: the encoder, BERT's pooler (dense + tanh on ``[CLS]``)
    and a linear ``classifier``; the engine's pooler takes the ``[CLS]`` state and calls
    :meth:`classifier_head`."""

    has_lm_head: ClassVar[bool] = False

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        cfg = config.hf_config
        self.bert = BertModel(config, "bert.")
        self.bert_pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.classifier = nn.Linear(cfg.hidden_size, int(cfg.num_labels))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None
                ) -> torch.Tensor:
        return self.bert(input_ids, positions)

    def classifier_head(self, cls_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` ``[CLS]`` states -> ``[N, num_labels]`` logits."""
        return self.classifier(torch.tanh(self.bert_pooler(cls_states)))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a sequence classifier has no LM head and cannot generate")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((n.replace("bert.pooler.dense.", "bert_pooler."), t) for n, t in weights)
        return _load_by_name(self, renamed, "", skip=("embeddings.position_ids",))


class XLMRobertaForSequenceClassification(nn.Module):
    """transformers' XLMRobertaForSequenceClassification: the encoder and RoBERTa's classification head
    (dense + tanh + ``out_proj`` on the ``<s>`` state)."""

    has_lm_head: ClassVar[bool] = False

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        cfg = config.hf_config
        self.roberta = XLMRobertaModel(config, "roberta.")
        self.classifier = nn.ModuleDict({"dense": nn.Linear(cfg.hidden_size, cfg.hidden_size),
                                         "out_proj": nn.Linear(cfg.hidden_size, int(cfg.num_labels))})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None
                ) -> torch.Tensor:
        return self.roberta(input_ids, positions)

    def classifier_head(self, cls_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` ``<s>`` states -> ``[N, num_labels]`` logits."""
        return self.classifier["out_proj"](torch.tanh(self.classifier["dense"](cls_states)))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a sequence classifier has no LM head and cannot generate")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return _load_by_name(self, weights, "", skip=("embeddings.position_ids", "roberta.pooler."))


_QKV_NAME = re.compile(r"\.attention\.self\.(query|key|value)\.")


def _load_by_name(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], strip: str,
                  skip: tuple[str, ...]) -> set[str]:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if strip and name.startswith(strip):
            name = name[len(strip):]
        for prefix in ("bert.", "roberta."):  # an encoder checkpoint saved from a task model
            if name.startswith(prefix) and name not in params and name[len(prefix):] in params:
                name = name[len(prefix):]
        if any(s in name for s in skip) or name.startswith(("cls.", "lm_head.")):
            continue
        shard = None
        match = _QKV_NAME.search(name)
        if match is not None:  # transformers' separate projections -> the fused qkv parameter
            shard = match.group(1)[0]
            name = name[: match.start()] + ".attention.self.qkv." + name[match.end():]
        param = params.get(name)
        if param is None:
            raise KeyError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
        if shard is not None:
            param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
        else:
            if param.shape != tensor.shape:
                raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)} vs "
                                 f"{tuple(param.shape)}")
            param.data.copy_(tensor)
        loaded.add(name)
    return loaded


def _sep_token_id(config: Any) -> int | None:
    """The tokenizer's separator id (token types change after it), or ``None`` when it has none."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError):
        return None
    sep = getattr(tokenizer, "sep_token_id", None)
    return None if sep is None else int(sep)


def _token_type_ids(input_ids: torch.Tensor, positions: torch.Tensor, sep_token_id: int | None) -> torch.Tensor:
    """``[T]`` int64: 1 for the tokens of a sequence after its first separator, else 0 (sequences are whole and
    start at position 0)."""
    if sep_token_id is None:
        return torch.zeros_like(input_ids)
    is_sep = (input_ids == sep_token_id).to(torch.int64)
    seps_before = torch.cumsum(is_sep, 0) - is_sep
    start = torch.arange(input_ids.shape[0], device=input_ids.device) - positions
    return ((seps_before - seps_before[start]) > 0).to(torch.int64)
