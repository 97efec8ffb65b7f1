"""Mixture-of-experts through one fused-experts op (Mixtral, Qwen3-MoE, Nemotron-H), with a platform hook for the
kernel.

:class:`FusedMoE` holds every expert's weights as two stacked tensors and routes tokens: softmax over the router
logits in float32, top-k, optionally renormalised to sum to one (Mixtral always; Qwen3-MoE when
``norm_topk_prob``), as in transformers; a model with another routing rule (Nemotron-H's sigmoid scores with a
correction bias, :mod:`tokenmill.layers.moe_routing`) routes itself and calls :meth:`FusedMoE.apply_routed`.
Experts are gated MLPs (``w13`` holds gate and up rows) or, with ``gated=False``, plain ones (``w13`` holds the
up rows only: Nemotron-H's ``relu2`` experts). The expert computation is a :class:`FusedMoEMethod` chosen by the
platform (``Platform.get_fused_moe_cls``); the portable one, :class:`TorchFusedMoEMethod`, sorts the
``T * top_k`` (token, expert) pairs by expert and runs each projection as one grouped matrix multiply over
those groups (``torch.nn.functional.grouped_mm``; a loop over experts where that op is unavailable), with no
Python loop over tokens.

Tensor parallelism: every rank holds all experts, each with a slice of the intermediate dimension (columns
of gate/up, rows of down, Megatron style), and the layer sums the ranks' partial outputs.

Under ``torch.compile`` a method that is not ``traceable`` runs as the opaque custom op
``tokenmill::fused_moe`` (like attention), so it may synchronise with the host inside.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import get_tp_rank, get_tp_size, tp_all_reduce
from tokenmill.layers.activation import get_act_and_mul, get_act_fn
from tokenmill.layers.linear import ReplicatedLinear

DEFAULT_FUSED_MOE = "tokenmill.layers.fused_moe:TorchFusedMoEMethod"


class FusedMoEMethod(ABC):
    """How a platform computes the experts of routed tokens (stateless; one instance per layer).

    Attributes:
        traceable: ``apply`` can be traced by torch.compile (no host synchronisation, only torch ops);
            otherwise compiled graphs call it through the opaque ``tokenmill::fused_moe`` op.
    """

    traceable: ClassVar[bool] = False

    @abstractmethod
    def apply(
        self,
        hidden_states: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str,
    ) -> torch.Tensor:
        """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden_states[t])`` for every token ``t``.

        Args:
            hidden_states: ``[T, H]``.
            w13: ``[E, 2 * I, H]``, each expert's gate rows then up rows (this rank's ``I``); or ``[E, I, H]``,
                up rows only, for experts without a gate (the activation then applies elementwise).
            w2: ``[E, H, I]``, each expert's down projection.
            topk_weights: ``[T, k]`` float32 routing weights.
            topk_ids: ``[T, k]`` int64 expert ids.
            activation: transformers' ``hidden_act`` name of the experts' activation (``"silu"`` for SwiGLU,
                ``"relu2"`` for Nemotron-H's experts without a gate).

        Returns:
            ``[T, H]`` in ``hidden_states``' dtype (this rank's partial sum under tensor parallelism).
        """


class TorchFusedMoEMethod(FusedMoEMethod):
    """Portable torch implementation: (token, expert) pairs sorted by expert, grouped matrix multiplies."""

    def apply(
        self,
        hidden_states: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str,
    ) -> torch.Tensor:
        num_experts, top_k = w13.shape[0], topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        token = order // top_k
        counts = torch.bincount(flat, minlength=num_experts)
        x = hidden_states[token]
        h = _grouped_linear(x, w13, counts)  # [T*k, 2I]
        h = _activation(activation, w13.shape[1] != w2.shape[2])(h)
        y = _grouped_linear(h, w2, counts)  # [T*k, H]
        y = (y.float() * topk_weights.reshape(-1)[order].unsqueeze(1)).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, token, y)


@functools.cache
def _activation(name: str, gated: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    return get_act_and_mul(name) if gated else get_act_fn(name)


_GROUPED_MM_UNSUPPORTED: set[tuple[str, torch.dtype]] = set()


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` rows grouped by expert (``counts [E]`` rows each, in order) times ``w[e] [N, K]``^T:
    ``[M, N]``."""
    key = (x.device.type, x.dtype)
    if hasattr(F, "grouped_mm") and key not in _GROUPED_MM_UNSUPPORTED:
        try:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            return F.grouped_mm(x, w.transpose(1, 2), offs=offs)
        except (RuntimeError, NotImplementedError):  # dtype/device/alignment this torch does not support
            _GROUPED_MM_UNSUPPORTED.add(key)
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):  # a loop over experts (host sync), not over tokens
        if n:
            torch.matmul(x[start : start + n], w[e].t(), out=out[start : start + n])
        start += n
    return out


@functools.cache
def _method_instance(path: str) -> FusedMoEMethod:
    from tokenmill.plugins import resolve_qualname

    cls = resolve_qualname(path)
    if not (isinstance(cls, type) and issubclass(cls, FusedMoEMethod)):
        raise TypeError(f"fused MoE method {path!r} is not a FusedMoEMethod subclass")
    return cls()


def get_fused_moe_method_path() -> str:
    """``"module:Class"`` of the :class:`FusedMoEMethod` to use: a ``fused_moe`` custom op registered by the
    script or a plugin, else the current platform's ``get_fused_moe_cls()`` (see
    :mod:`tokenmill.layers.custom_op`)."""
    from tokenmill.layers.custom_op import CustomOpRegistry
    from tokenmill.platforms import get_current_platform

    target = CustomOpRegistry.lookup("fused_moe")
    if target is not None:
        return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
    return get_current_platform().get_fused_moe_cls() or DEFAULT_FUSED_MOE


@torch.library.custom_op("tokenmill::fused_moe", mutates_args=())
def fused_moe_op(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    method: str,
    activation: str,
) -> torch.Tensor:
    """The experts of one MoE layer as one opaque op for torch.compile: ``[T, H]`` (see FusedMoEMethod.apply)."""
    return _method_instance(method).apply(hidden_states, w13, w2, topk_weights, topk_ids, activation).contiguous()


@fused_moe_op.register_fake
def _(hidden_states, w13, w2, topk_weights, topk_ids, method, activation):  # noqa: ANN001, ANN202
    return torch.empty_like(hidden_states)


class FusedMoE(nn.Module):
    """All experts of one layer plus top-k routing.

    Args:
        num_experts: E.
        top_k: experts per token.
        hidden_size: H.
        intermediate_size: each expert's I (split across tensor-parallel ranks).
        renormalize: rescale the top-k probabilities to sum to one.
        activation: transformers' ``hidden_act`` of the experts' MLP.
        gated: the experts are gated MLPs (gate and up projections); ``False``: an up projection only.

    Parameters ``w13_weight [E, 2 * I / tp, H]`` (gate rows, then up rows; ``[E, I / tp, H]``, up rows, without a
    gate) and ``w2_weight [E, H, I / tp]`` take checkpoint tensors through ``weight_loader(param, tensor,
    shard_id, expert_id)``; each carries ``expert_shards``, the shard ids that fill it.

    Raises:
        ValueError: ``top_k > num_experts`` or I not divisible by the tensor-parallel size.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool = True,
        activation: str = "silu",
        gated: bool = True,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts ({num_experts})")
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if intermediate_size % self.tp_size:
            raise ValueError(f"expert intermediate size ({intermediate_size}) is not divisible by the "
                             f"tensor-parallel size ({self.tp_size})")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.activation, self.gated = activation, gated
        _activation(activation, gated)  # fail early on an unsupported one
        self.intermediate_per_rank = intermediate_size // self.tp_size
        i = self.intermediate_per_rank
        self.w13_weight = nn.Parameter(torch.empty(num_experts, (2 if gated else 1) * i, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i), requires_grad=False)
        self.w13_weight.expert_shards = ("w1", "w3") if gated else ("w3",)  # type: ignore[attr-defined]
        self.w2_weight.expert_shards = ("w2",)  # type: ignore[attr-defined]
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.method_path = get_fused_moe_method_path()
        self.method = _method_instance(self.method_path)
        self.prefix = prefix

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str, expert_id: int | None = None
    ) -> None:
        """Copy this rank's part of a checkpoint tensor.

        Args:
            shard_id: ``"w1"`` (gate), ``"w3"`` (up), ``"w2"`` (down), or ``"w13"`` (gate and up fused, as
                transformers' ``experts.gate_up_proj``); experts without a gate take ``"w3"`` and ``"w2"``.
            expert_id: the expert of a 2-D tensor ``[I, H]`` / ``[H, I]``; ``None`` for a 3-D tensor holding
                every expert (``[E, I, H]``, ``[E, 2I, H]``, ``[E, H, I]``).

        Raises:
            ValueError: unknown shard id (a gate for experts without one) or shapes that do not match.
        """
        if not self.gated and shard_id in ("w1", "w13"):
            raise ValueError(f"FusedMoE: shard {shard_id!r} is a gate projection; these experts have none (w3, w2)")
        if shard_id == "w13":
            gate, up = loaded.chunk(2, dim=-2)
            self.weight_loader(param, gate, "w1", expert_id)
            self.weight_loader(param, up, "w3", expert_id)
            return
        i, r = self.intermediate_per_rank, self.tp_rank
        if shard_id in ("w1", "w3"):
            src = loaded.narrow(-2, r * i, i)
            dst = param.data.narrow(-2, 0 if shard_id == "w1" or not self.gated else i, i)
        elif shard_id == "w2":
            src = loaded.narrow(-1, r * i, i)
            dst = param.data
        else:
            raise ValueError(f"FusedMoE: unknown shard id {shard_id!r} (w1, w2, w3, w13)")
        if expert_id is not None:
            dst = dst[expert_id]
        if dst.shape != src.shape:
            raise ValueError(f"shape mismatch for experts {shard_id}: parameter slice {tuple(dst.shape)} vs "
                             f"checkpoint {tuple(src.shape)}")
        dst.copy_(src)

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``router_logits [T, E]`` -> ``(topk_weights [T, k] float32, topk_ids [T, k] int64)``."""
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``hidden_states [T, H]``, ``router_logits [T, E]`` -> ``[T, H]`` (summed over ranks)."""
        return self.apply_routed(hidden_states, *self.select_experts(router_logits))

    def apply_routed(self, hidden_states: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts of tokens already routed: ``hidden_states [T, H]``, ``weights [T, k]`` float32, ``ids [T,
        k]`` int64 -> ``[T, H]`` (summed over ranks)."""
        if torch.compiler.is_compiling() and not self.method.traceable:
            out = torch.ops.tokenmill.fused_moe(hidden_states, self.w13_weight, self.w2_weight, weights, ids,
                                                self.method_path, self.activation)
        else:
            out = self.method.apply(hidden_states, self.w13_weight, self.w2_weight, weights, ids, self.activation)
        return tp_all_reduce(out)


class SparseMoeBlock(nn.Module):
    """Router (``gate``, replicated) plus :class:`FusedMoE` (``experts``): the MLP of an MoE decoder layer.

    Args: as :class:`FusedMoE`.
    """

    # Same arguments as FusedMoE.__init__ (the block passes them on to its ``experts``).
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool = True,
        activation: str = "silu",
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.gate.quantizable = False  # --quantization must not change which experts a token goes to
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize=renormalize,
                                activation=activation, prefix=f"{prefix}.experts")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]``."""
        return self.experts(hidden_states, self.gate(hidden_states))
