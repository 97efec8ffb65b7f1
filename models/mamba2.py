"""Mamba2 (Dao & Gu 2024): an attention-free stack of Mamba2 mixers, parameter names as in transformers'
``Mamba2ForCausalLM`` (``backbone.embeddings``, ``backbone.layers.<i>.{norm,mixer}``, ``backbone.norm_f``,
``lm_head``). Every layer keeps its per-request state in the hybrid cache's state slots (no KV blocks)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.layers import ParallelLMHead, RMSNorm, VocabParallelEmbedding
from tokenmill.layers.mamba import MambaMixer2


def mamba2_mixer(cfg: Any) -> MambaMixer2:
    """The mixer of transformers' ``Mamba2Config`` (``expand``, ``num_heads``, ``head_dim``, ``n_groups``,
    ``state_size``, ``conv_kernel``, ``chunk_size``, ``time_step_limit``)."""
    return MambaMixer2(
        cfg.hidden_size, cfg.state_size, cfg.conv_kernel, int(cfg.expand * cfg.hidden_size), cfg.num_heads,
        cfg.head_dim, cfg.n_groups, use_conv_bias=bool(cfg.use_conv_bias), use_bias=bool(cfg.use_bias),
        rms_norm_eps=float(cfg.layer_norm_epsilon), chunk_size=int(cfg.chunk_size),
        time_step_limit=tuple(cfg.time_step_limit), activation=cfg.hidden_act,
    )


class Mamba2Block(nn.Module):
    """``x + mixer(norm(x))``; with ``residual_in_fp32`` the residual stream stays float32 (transformers)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(getattr(cfg, "residual_in_fp32", True))
        self.norm = RMSNorm(cfg.hidden_size, float(cfg.layer_norm_epsilon))
        self.mixer = mamba2_mixer(cfg)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states.float() if self.residual_in_fp32 else hidden_states
        out = self.mixer(self.norm(hidden_states.to(self.norm.weight.dtype)))
        return residual + out


class Mamba2Model(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Mamba2Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, float(cfg.layer_norm_epsilon))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        dtype = hidden.dtype
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm_f(hidden.to(dtype))


class Mamba2ForCausalLM(nn.Module):
    """The model contract for transformers' ``Mamba2Config`` checkpoints (tensor and pipeline parallelism are
    refused at start-up: the state layers run on one rank)."""

    is_hybrid: ClassVar[bool] = True
    is_attention_free: ClassVar[bool] = True
    supports_pp: ClassVar[bool] = False

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        cfg = config.hf_config
        self.config = cfg
        self.backbone = Mamba2Model(cfg)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None
                ) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[T]`` int64 -> ``[T, hidden]`` (positions are not used: the state
        carries the order)."""
        return self.backbone(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from tokenmill.model_loader.weight_utils import load_checkpoint_weights

        loaded = load_checkpoint_weights(
            self, weights, checkpoint_name_remap={"backbone.embedding.": "backbone.embeddings."},
            ignore_names=("lm_head.weight",) if self.tie_word_embeddings else (),
        )
        if self.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded
