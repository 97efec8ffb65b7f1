"""Resolving a user's speculative-decoding settings against the engine configuration."""

from __future__ import annotations

from typing import Any

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.spec_decode.config import SpeculativeConfig


def create_speculative_config(value: SpeculativeConfig | dict[str, Any] | str, config: EngineConfig) -> SpeculativeConfig:
    """Parse ``value`` and check it against ``config``; for ``draft_model`` also load the draft's config.

    Raises:
        ValueError: bad settings (see :meth:`SpeculativeConfig.validate`), pipeline parallelism (not supported
            with speculation), a draft model with tensor parallelism, or a draft whose vocabulary size or context
            length does not fit the target model's (the message names both models).
        FileNotFoundError: the draft model path does not exist.
    """
    spec = SpeculativeConfig.from_user(value)
    pc = config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise ValueError("speculative_config: speculative decoding does not support pipeline_parallel_size > 1 yet")
    if spec.method == "draft_model":
        if getattr(config, "lora_config", None) is not None:
            raise ValueError(
                "speculative_config: the draft_model method does not support --enable-lora (the draft model "
                "cannot apply the requests' LoRA adapters); use the ngram method or turn LoRA off"
            )
        if pc.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config: the draft_model method does not support tensor_parallel_size > 1 yet "
                "(the ngram method does)"
            )
        spec.draft_model_config = _draft_model_config(spec.model or "", config.model_config)
    return spec


def _draft_model_config(path: str, target: ModelConfig) -> ModelConfig:
    from tokenmill.model_loader.hf_config import derived_max_model_len, load_hf_config, resolve_model_location

    loc = resolve_model_location(path)
    hf_config = load_hf_config(loc.directory, loc.gguf_file, trust_remote_code=target.trust_remote_code)
    draft = ModelConfig(
        model=loc.path,
        tokenizer=loc.directory,
        hf_config=hf_config,
        gguf_file=loc.gguf_file,
        dtype=target.dtype,
        max_model_len=target.max_model_len,
        served_model_name=f"{target.served_model_name}-draft",
        seed=target.seed,
        trust_remote_code=target.trust_remote_code,
    )
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft model {path!r} has a vocabulary of {draft.vocab_size} tokens but "
            f"the target model {target.model!r} has {target.vocab_size}; the draft must use the target's "
            "tokenizer (same vocabulary)"
        )
    draft_len = derived_max_model_len(hf_config)
    if draft_len is not None and draft_len < target.max_model_len:  # None: no position limit (state-space)
        raise ValueError(
            f"speculative_config.model: the draft model {path!r} supports {draft_len} positions, fewer than "
            f"max_model_len {target.max_model_len}; lower --max-model-len"
        )
    return draft
