"""Config overrides (vLLM's ``hf_overrides``) and classifiers made from a causal LM's token logits.

A reranker such as Qwen3-Reranker ships as a ``Qwen3ForCausalLM``: its relevance is the probability of the
answer "yes" against "no" at the last prompt position. vLLM serves it as a sequence classifier with::

    --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
                     "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'

and tokenmill reads the same overrides. The classifier's ``score`` weight is then built from LM-head rows
(vLLM's documented conversion, re-derived here): with two tokens ``[false, true]`` and
``is_original_qwen3_reranker`` (or ``method: "from_2_way_softmax"``) it is one row, ``W[true] - W[false]``,
so the one-label sigmoid of the score equals the softmax of the two token logits at the true token:
``sigmoid(l_true - l_false) = exp(l_true) / (exp(l_true) + exp(l_false))``. Otherwise (``method:
"no_post_processing"``) each token's row is one label and the classifier returns the softmax over those
tokens' logits.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.config import parse_json_object

TWO_WAY = "from_2_way_softmax"
PER_TOKEN = "no_post_processing"


def parse_hf_overrides(value: dict[str, Any] | str | None) -> dict[str, Any]:
    """``--hf-overrides`` as a dict (a JSON object given as text, or a dict already).

    Raises:
        ValueError: not a JSON object.
    """
    if value is None or value == "":
        return {}
    return parse_json_object(value, "hf_overrides")


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any]) -> None:
    """Set each ``overrides`` field on the transformers config (nested dicts update nested configs), then make
    a token classifier's label count match its tokens (see :func:`token_classifier_spec`).

    Raises:
        ValueError: ``classifier_from_token`` is malformed.
    """
    for key, value in overrides.items():
        current = getattr(hf_config, key, None)
        if isinstance(value, dict) and current is not None and not isinstance(current, dict):
            apply_hf_overrides(current, value)
        else:
            setattr(hf_config, key, value)
    spec = token_classifier_spec(hf_config)
    if spec is not None:
        tokens, method = spec
        num_labels = 1 if method == TWO_WAY else len(tokens)
        hf_config.num_labels = num_labels
        hf_config.id2label = {0: tokens[-1]} if method == TWO_WAY else dict(enumerate(tokens))
        hf_config.label2id = {v: k for k, v in hf_config.id2label.items()}


def token_classifier_spec(hf_config: Any) -> tuple[list[str], str] | None:
    """``(tokens, method)`` when the config asks for a classifier made of LM-head rows, else ``None``.

    Raises:
        ValueError: the tokens are not a non-empty list of strings, the method is unknown, or the two-way
            softmax is asked for with other than two tokens.
    """
    tokens = getattr(hf_config, "classifier_from_token", None)
    if tokens is None:
        return None
    if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"hf_overrides: classifier_from_token must be a list of token strings, got {tokens!r}")
    method = getattr(hf_config, "method", None)
    if method is None:
        method = TWO_WAY if getattr(hf_config, "is_original_qwen3_reranker", False) else PER_TOKEN
    if method not in (TWO_WAY, PER_TOKEN):
        raise ValueError(f"hf_overrides: method must be {TWO_WAY} or {PER_TOKEN}, got {method!r}")
    if method == TWO_WAY and len(tokens) != 2:
        raise ValueError(f"hf_overrides: {TWO_WAY} needs two tokens [false, true], got {tokens!r}")
    return list(tokens), method


def token_ids(tokenizer: Any, tokens: list[str]) -> list[int]:
    """The vocabulary id of each token string (the tokenizer's ``convert_tokens_to_ids``).

    Raises:
        ValueError: a token is not one vocabulary entry.
    """
    ids = []
    unk = getattr(tokenizer, "unk_token_id", None)
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or (unk is not None and token_id == unk and token != tokenizer.unk_token):
            raise ValueError(f"classifier_from_token: {token!r} is not a token of the model's vocabulary")
        ids.append(int(token_id))
    return ids


def score_weight_from_lm_head(lm_head: torch.Tensor, ids: list[int], method: str) -> torch.Tensor:
    """The classifier weight, ``[num_labels, hidden]``, from the LM head ``[vocab, hidden]``: the rows of
    ``ids`` (``no_post_processing``), or their difference ``W[ids[1]] - W[ids[0]]`` (``from_2_way_softmax``;
    computed in float32, then cast back)."""
    rows = lm_head[ids].float()
    if method == TWO_WAY:
        rows = (rows[1] - rows[0])[None]
    return rows.to(lm_head.dtype)
