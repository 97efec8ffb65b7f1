"""Decoder layers, the decoder stack and the causal-LM wrapper every built-in family is made of.

A family is a small file: a ``DecoderLayer`` subclass that builds its attention and MLP from the config, and a
``DecoderForCausalLM`` subclass naming that layer class (``layer_type``) and the checkpoint tables. The model
contract (``forward(input_ids, positions)``, ``compute_logits``, ``load_weights``) is implemented here once.

Norm placements (``norm_style``), with transformers' parameter names:

* ``"pre"`` (Llama, Qwen, Mistral, Phi-3, Granite, Mixtral): ``input_layernorm`` before attention,
  ``post_attention_layernorm`` before the MLP; residual adds fused into the norms.
* ``"sandwich"`` (Gemma 2 / 3): also ``post_attention_layernorm`` on the attention output and
  ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the MLP.
* ``"post"`` (OLMo 2): no input norm; ``post_attention_layernorm`` and ``post_feedforward_layernorm`` on each
  sublayer's output before its residual add.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from tokenmill.distributed import get_pp_group
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.pipeline import (
    IntermediateTensors,
    PPMissingLayer,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    make_layers,
)
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

NormStyle = Literal["pre", "sandwich", "post"]

# (parameter fragment, checkpoint fragment, shard id): q/k/v into qkv_proj, gate/up into gate_up_proj.
DEFAULT_STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


class DecoderLayer(nn.Module):
    """Attention + MLP with residual connections and the norms of ``norm_style``.

    Args:
        self_attn: ``forward(positions [T], hidden [T, H]) -> [T, H]`` (e.g. :class:`DecoderAttention`).
        mlp: ``forward(hidden [T, H]) -> [T, H]`` (a :class:`GatedMLP` or an MoE block).
        hidden_size: H.
        eps: the norms' epsilon.
        norm_style: ``"pre"``, ``"sandwich"`` or ``"post"`` (module docstring).
        norm_offset, norm_in_float32: see :class:`RMSNorm` (Gemma: ``1.0`` and ``True``).
        residual_multiplier: each sublayer's output is scaled by it before its residual add (Granite).

    ``forward(positions, hidden_states, residual) -> (hidden_states, residual)``: the residual stream is passed
    separately so the next norm can fuse the add; the model's final norm adds the last one.
    """

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        hidden_size: int,
        eps: float,
        *,
        norm_style: NormStyle = "pre",
        norm_offset: float = 0.0,
        norm_in_float32: bool = False,
        residual_multiplier: float = 1.0,
    ) -> None:
        super().__init__()
        if norm_style not in ("pre", "sandwich", "post"):
            raise ValueError(f"norm_style must be 'pre', 'sandwich' or 'post', got {norm_style!r}")
        self.self_attn = self_attn
        self.mlp = mlp
        self.norm_style = norm_style
        self.residual_multiplier = residual_multiplier

        def norm() -> RMSNorm:
            return RMSNorm(hidden_size, eps, offset=norm_offset, multiply_in_float32=norm_in_float32)

        if norm_style != "post":
            self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if norm_style != "pre":
            if norm_style == "sandwich":
                self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.norm_style == "post":
            if residual is not None:
                hidden_states = hidden_states + residual
            residual = hidden_states
            h = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
            residual = residual + self._scaled(h)
            h = self.post_feedforward_layernorm(self.mlp(residual))
            return self._scaled(h), residual
        if residual is None:
            residual = hidden_states
            h = self.input_layernorm(hidden_states)
        else:
            h, residual = self.input_layernorm(hidden_states, residual)
        h = self.self_attn(positions, h)
        if self.norm_style == "sandwich":
            h = self.post_attention_layernorm(h)
            h, residual = self.pre_feedforward_layernorm(self._scaled(h), residual)
            h = self.post_feedforward_layernorm(self.mlp(h))
        else:
            h, residual = self.post_attention_layernorm(self._scaled(h), residual)
            h = self.mlp(h)
        return self._scaled(h), residual


class DecoderModel(nn.Module):
    """Token embedding, the decoder layers, the final norm (transformers' ``model.*`` names).

    Args:
        config: the engine's ModelConfig (``config.hf_config`` is the transformers config).
        layer_type: called as ``layer_type(config, layer_idx, prefix)`` for each layer; returns a module with
            :class:`DecoderLayer`'s ``forward``.
        prefix: the module's name (``"model"``).
        embedding_multiplier: the embeddings are scaled by it (Gemma: ``sqrt(H)`` rounded to the model dtype;
            Granite: ``embedding_multiplier``).
        norm_offset, norm_in_float32: the final norm's settings.
        norm_eps: the final norm's epsilon (default: the config's ``rms_norm_eps``, else ``1e-6``).

    The forward pass is ``embed -> layers -> norm`` over ``self.layers`` in order. Under pipeline parallelism
    (docs/distributed.md) each stage builds only its range ``[start_layer, end_layer)`` of the layers
    (:func:`~tokenmill.layers.pipeline.make_layers`), the embedding only on the first stage and the final norm
    only on the last (:class:`~tokenmill.layers.pipeline.PPMissingLayer` elsewhere); a stage other than the
    last returns ``IntermediateTensors`` with ``hidden_states`` and ``residual``, ``[T, H]`` each.
    """

    def __init__(
        self,
        config: Any,
        *,
        layer_type: type[nn.Module] | Any,
        prefix: str = "model",
        embedding_multiplier: float | None = None,
        norm_offset: float = 0.0,
        norm_in_float32: bool = False,
        norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        cfg = config.hf_config
        pp = get_pp_group()
        if norm_eps is None:
            norm_eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if pp.is_first_rank else PPMissingLayer()
        )
        self.embedding_multiplier = embedding_multiplier
        self.start_layer, self.end_layer, self.layers = make_layers(
            cfg.num_hidden_layers,
            lambda name: layer_type(config, int(name.rsplit(".", 1)[1]), name),
            f"{prefix}.layers",
        )
        self.norm = (
            RMSNorm(cfg.hidden_size, norm_eps, offset=norm_offset,
                    multiply_in_float32=norm_in_float32)
            if pp.is_last_rank
            else PPMissingLayer()
        )
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], cfg.hidden_size
        )
        ropes = {id(m): m for m in self.modules() if isinstance(m, RotaryEmbedding)}
        self._rotary_embs: tuple[RotaryEmbedding, ...] = tuple(ropes.values())  # plain attribute: not registered

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int64 -> ``[T, H]`` token embeddings, scaled by ``embedding_multiplier``."""
        hidden_states = self.embed_tokens(input_ids)
        if self.embedding_multiplier is not None:
            hidden_states = hidden_states * self.embedding_multiplier
        return hidden_states

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """``input_ids``, ``positions``: ``[T]`` int64 -> hidden states ``[T, H]`` (a non-last pipeline stage:
        ``IntermediateTensors`` for the next stage; a non-first one continues from ``intermediate_tensors``).
        ``inputs_embeds`` ``[T, H]``: the first layer's input as it is, instead of :meth:`embed_input_ids`
        (a vision-language model's text embeddings with image rows merged in)."""
        pp = get_pp_group()
        eager = not torch.compiler.is_compiling()
        if eager:  # one cos/sin lookup per rope per forward pass, recorded by a graph capture around it
            for rope in self._rotary_embs:
                rope.begin_step(positions)
        if pp.is_first_rank:
            hidden_states = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            if intermediate_tensors is None:
                raise ValueError("a pipeline stage after the first needs the previous stage's intermediate_tensors")
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if eager:
            for rope in self._rotary_embs:
                rope.end_step()
        if not pp.is_last_rank:
            assert residual is not None  # every stage holds at least one layer
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        if residual is None:
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """The model contract on top of :class:`DecoderModel`: LM head (tied or not), logit scaling / soft cap,
    and the generic weight loader.

    Subclasses set ``layer_type`` and, where they differ, the class attributes below or
    :meth:`model_kwargs`.

    Attributes:
        layer_type: the decoder layer class (``layer_type(config, layer_idx, prefix)``).
        stacked_params_mapping: ``(param_fragment, checkpoint_fragment, shard_id)`` rows (see
            ``tokenmill.model_loader.weight_utils``).
        expert_weight_names: per-expert checkpoint projection -> FusedMoE shard, for MoE families.
        checkpoint_name_remap: substring replacements on checkpoint names.
        final_logit_softcap: ``c * tanh(logits / c)`` (Gemma 2's ``final_logit_softcapping``).

    Args:
        config: the engine's ModelConfig.
    """

    layer_type: ClassVar[Any] = None
    supports_pp: ClassVar[bool] = True  # the pipeline-parallel model contract (docs/distributed.md)
    stacked_params_mapping: ClassVar[tuple[tuple[str, str, str | int], ...]] = DEFAULT_STACKED_PARAMS
    expert_weight_names: ClassVar[Mapping[str, str] | None] = None
    checkpoint_name_remap: ClassVar[Mapping[str, str]] = {}

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        cfg = config.hf_config
        self.config = cfg
        self.model = DecoderModel(config, layer_type=self.layer_type, **self.model_kwargs(cfg))
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        pp = get_pp_group()
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if pp.is_last_rank else PPMissingLayer()
        # A tied head shares the embedding only when both live on this stage; on a later stage it loads its own
        # copy of the embedding's checkpoint tensor.
        self._tied_here = self.tie_word_embeddings and pp.world_size == 1
        if self._tied_here:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self.final_logit_softcap: float | None = None

    def model_kwargs(self, hf_config: Any) -> dict[str, Any]:
        """Extra keyword arguments of :class:`DecoderModel` (embedding multiplier, final norm settings)."""
        return {}

    # Same signature as DecoderModel.forward, which it calls: the model contract's forward.
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """``input_ids``, ``positions``: ``[T]`` int64 -> hidden states ``[T, hidden]`` (see
        :meth:`DecoderModel.forward` for pipeline stages and ``inputs_embeds``)."""
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` logits (the weights' dtype; the sampler widens to float32 as needed)."""
        logits = self.lm_head.compute_logits(hidden_states)
        if self.final_logit_softcap is not None:
            cap = self.final_logit_softcap
            logits = (torch.tanh(logits.float() / cap) * cap).to(logits.dtype)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors; returns the parameter names that were filled.

        Raises:
            KeyError: a checkpoint tensor has no matching parameter.
        """
        from tokenmill.model_loader.weight_utils import load_checkpoint_weights

        loaded = load_checkpoint_weights(
            self,
            self._this_stage(weights),
            stacked_params_mapping=self.stacked_params_mapping,
            expert_weight_names=self.expert_weight_names,
            checkpoint_name_remap=self.checkpoint_name_remap,
            ignore_names=("lm_head.weight",) if self.tie_word_embeddings else (),
        )
        if self.tie_word_embeddings and isinstance(self.lm_head, ParallelLMHead):
            loaded.add("lm_head.weight")
        return loaded

    def _this_stage(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint tensors this pipeline stage holds (all of them without pipeline parallelism)."""
        if get_pp_group().world_size == 1:
            yield from weights
            return
        last = get_pp_group().is_last_rank
        for name, tensor in weights:
            if self.tie_word_embeddings and last and name == "model.embed_tokens.weight":
                self.lm_head.weight_loader(self.lm_head.weight, tensor)  # type: ignore[union-attr]
            if not is_pp_missing_parameter(name, self):
                yield name, tensor
