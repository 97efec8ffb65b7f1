"""Llama (Touvron et al. 2023) and Llama-layout models, written only from ``tokenmill.layers``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.distributed import get_pp_group, get_tp_size
from tokenmill.layers import (
    Attention,
    IntermediateTensors,
    MergedColumnParallelLinear,
    PPMissingLayer,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    default_weight_loader,
    get_rope,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    make_layers,
)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, max_position: int, prefix: str) -> None:
        super().__init__()
        tp = get_tp_size()
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        total_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads, total_kv, bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.num_heads = cfg.num_attention_heads // tp
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.rotary_emb = get_rope(self.head_dim, max_position, cfg)
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, prefix=f"{prefix}.attn"
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, max_position: int, prefix: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, max_position, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, bool(getattr(cfg, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, max_position: int, prefix: str = "model") -> None:
        super().__init__()
        # PP: each pipeline stage builds only its layers; the embedding lives on the first stage, the norm
        # on the last (PPMissingLayer elsewhere). With one stage this is the plain model.
        pp = get_pp_group()
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if pp.is_first_rank else PPMissingLayer()
        )
        self.start_layer, self.end_layer, self.layers = make_layers(
            cfg.num_hidden_layers, lambda p: LlamaDecoderLayer(cfg, max_position, prefix=p), f"{prefix}.layers"
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if pp.is_last_rank else PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], cfg.hidden_size
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: IntermediateTensors | None = None
    ) -> torch.Tensor | IntermediateTensors:
        pp = get_pp_group()
        if pp.is_first_rank:
            hidden_states = self.embed_tokens(input_ids)
            residual = None
        else:  # PP: a later stage continues from the previous stage's activations
            assert intermediate_tensors is not None
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not pp.is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """The model contract of DESIGN.md section 4.

    Args:
        config: the engine's ModelConfig; ``config.hf_config`` is a transformers LlamaConfig (or compatible).
    """

    supports_pp = True  # PP: the pipeline-parallel model contract (see tokenmill.layers.pipeline)

    # checkpoint name fragment -> (parameter name fragment, shard id)
    stacked_params = [
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0),
        (".up_proj", ".gate_up_proj", 1),
    ]

    def __init__(self, config: ModelConfig, prefix: str = "") -> None:
        super().__init__()
        cfg = config.hf_config
        self.config = cfg
        max_position = max(config.max_model_len, int(getattr(cfg, "max_position_embeddings", 0) or 0))
        self.model = LlamaModel(cfg, max_position)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        pp = get_pp_group()
        # PP: the LM head lives on the last stage; tied to the embedding only when both are on this stage.
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if pp.is_last_rank else PPMissingLayer()
        self._tied_here = self.tie_word_embeddings and pp.world_size == 1
        if self._tied_here:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: IntermediateTensors | None = None
    ) -> torch.Tensor | IntermediateTensors:
        """``input_ids``, ``positions``: ``[T]`` int64 -> hidden states ``[T, hidden]`` (on a non-last
        pipeline stage: ``IntermediateTensors`` for the next one)."""
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` logits (the weights' dtype; the sampler widens to float32 as needed)."""
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors; returns the parameter names that were filled.

        Raises:
            KeyError: a checkpoint tensor has no matching parameter.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        last_stage = get_pp_group().is_last_rank
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if self.tie_word_embeddings and not self._tied_here and last_stage and name == "model.embed_tokens.weight":
                # PP: a tied head on a later stage than the embedding loads its own copy of the embedding
                self.lm_head.weight_loader(self.lm_head.weight, tensor)
                loaded.add("lm_head.weight")
                continue
            if is_pp_missing_parameter(name, self):  # PP: another stage holds it
                continue
            for ckpt_part, param_part, shard in self.stacked_params:
                if ckpt_part in name:
                    target = name.replace(ckpt_part, param_part)
                    param = params.get(target)
                    if param is None:
                        raise KeyError(f"checkpoint tensor {name!r} has no parameter {target!r}")
                    param.weight_loader(param, tensor, shard)
                    loaded.add(target)
                    break
            else:
                param = params.get(name)
                if param is None:
                    raise KeyError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        if self._tied_here:
            loaded.add("lm_head.weight")
        return loaded
