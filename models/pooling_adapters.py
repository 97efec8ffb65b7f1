"""Decoder families used as pooling models: embedders (``Qwen3Model``-style checkpoints, or a causal LM served
with ``--convert embed``) and classifiers (``Qwen3ForSequenceClassification``: a ``score`` head on the pooled
state, as transformers defines it).

The decoder stack is the family's own; only the head changes. Checkpoints saved from transformers' bare
``*Model`` classes name their tensors without the ``model.`` prefix; it is added here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.layers import DecoderForCausalLM, PPMissingLayer
from tokenmill.model_loader.token_classifier import score_weight_from_lm_head, token_classifier_spec, token_ids
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.qwen2 import Qwen2ForCausalLM
from tokenmill.models.qwen3 import Qwen3ForCausalLM


class _DecoderWithoutLMHead(DecoderForCausalLM):
    """A decoder stack whose output is pooled, never turned into logits (no LM head is loaded)."""

    has_lm_head: ClassVar[bool] = False

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__(config, prefix)
        self.lm_head = PPMissingLayer()
        self.tie_word_embeddings = False

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} is a pooling model: it has no LM head and cannot generate")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint names with or without the ``model.`` prefix; an ``lm_head`` in the checkpoint is skipped."""
        heads = self._head_names()

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("lm_head."):
                    continue
                if not name.startswith("model.") and not any(name.startswith(h) for h in heads):
                    name = "model." + name
                yield name, tensor

        return super().load_weights(renamed())

    def _head_names(self) -> tuple[str, ...]:
        return ()


class _DecoderForSequenceClassification(_DecoderWithoutLMHead):
    """transformers' ``*ForSequenceClassification`` on a decoder: ``score`` (hidden -> num_labels, no bias)
    applied to the last token's hidden state (the pooler picks the token).

    With ``classifier_from_token`` in the config (``--hf-overrides``, as for Qwen3-Reranker), the checkpoint is
    a causal LM and ``score`` is built from its LM-head rows for those tokens
    (:mod:`tokenmill.model_loader.token_classifier`).
    """

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__(config, prefix)
        cfg = config.hf_config
        self.score = nn.Linear(cfg.hidden_size, int(getattr(cfg, "num_labels", 1) or 1), bias=False)
        self._token_classifier = token_classifier_spec(cfg)
        self._tokenizer_path = (config.tokenizer, config.trust_remote_code)

    def classifier_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, num_labels]`` logits."""
        return self.score(pooled.to(self.score.weight.dtype))

    def _head_names(self) -> tuple[str, ...]:
        return ("score.",)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As the decoder's; with a token classifier, ``score.weight`` comes from the LM head (or, with tied
        embeddings, the token embeddings).

        Raises:
            ValueError: the checkpoint has neither an LM head nor tied embeddings, or a token is not in the
                vocabulary.
        """
        if self._token_classifier is None:
            return super().load_weights(weights)
        kept: dict[str, torch.Tensor] = {}

        def watched() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name in ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight"):
                    kept["embed" if "embed_tokens" in name else "lm_head"] = tensor
                yield name, tensor

        loaded = super().load_weights(watched())
        head = kept.get("lm_head")
        if head is None and getattr(self.config, "tie_word_embeddings", False):
            head = kept.get("embed")
        if head is None:
            raise ValueError("classifier_from_token: the checkpoint has no lm_head.weight (and does not tie its "
                             "word embeddings), so there are no token logits to build the classifier from")
        from transformers import AutoTokenizer

        tokens, method = self._token_classifier
        path, trust = self._tokenizer_path
        ids = token_ids(AutoTokenizer.from_pretrained(path, trust_remote_code=trust), tokens)
        self.score.weight.data.copy_(score_weight_from_lm_head(head, ids, method))
        return loaded | {"score.weight"}


class Qwen3Model(_DecoderWithoutLMHead):
    layer_type = Qwen3ForCausalLM.layer_type


class Qwen2Model(_DecoderWithoutLMHead):
    layer_type = Qwen2ForCausalLM.layer_type


class LlamaModel(_DecoderWithoutLMHead):
    layer_type = LlamaForCausalLM.layer_type


class Qwen3ForSequenceClassification(_DecoderForSequenceClassification):
    layer_type = Qwen3ForCausalLM.layer_type


class Qwen2ForSequenceClassification(_DecoderForSequenceClassification):
    layer_type = Qwen2ForCausalLM.layer_type


class LlamaForSequenceClassification(_DecoderForSequenceClassification):
    layer_type = LlamaForCausalLM.layer_type
