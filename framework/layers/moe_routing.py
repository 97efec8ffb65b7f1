"""Top-k routing with sigmoid scores, a score correction bias and expert groups: DeepSeek-V3's router (DeepSeek-AI
2024, "auxiliary-loss-free load balancing"), which Nemotron-H's MoE layers use; the softmax router of Mixtral and
Qwen3-MoE is :meth:`tokenmill.layers.FusedMoE.select_experts`."""

from __future__ import annotations

import torch


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token as transformers' ``DeepseekV3TopkRouter`` / ``NemotronHTopkRouter`` do.

    Scores are ``sigmoid(router_logits)``; the choice uses ``scores + correction_bias``: the experts are split
    into ``num_expert_group`` equal groups, each group is rated by the sum of its two best biased scores, only the
    ``topk_group`` best groups stay eligible, and the ``top_k`` best biased scores among them are chosen. The
    weights are the unbiased scores of the chosen experts, divided by their sum (plus ``1e-20``) when
    ``renormalize``, times ``routed_scaling_factor``.

    Args:
        router_logits: ``[T, E]`` (any float dtype; computed in float32).
        top_k: experts per token.
        correction_bias: ``[E]`` added to the scores for the choice only (``None``: zero).
        num_expert_group, topk_group: groups of experts and how many of them stay eligible.
        renormalize: divide the chosen weights by their sum (transformers' ``norm_topk_prob``).
        routed_scaling_factor: the weights' final factor.

    Returns:
        ``(topk_weights [T, top_k] float32, topk_ids [T, top_k] int64)``.

    Raises:
        ValueError: ``num_expert_group`` does not divide ``E``, or ``topk_group`` / ``top_k`` out of range.
    """
    num_tokens, num_experts = router_logits.shape
    if num_experts % num_expert_group:
        raise ValueError(f"n_group: {num_expert_group} groups do not divide {num_experts} experts")
    if not 0 < topk_group <= num_expert_group:
        raise ValueError(f"topk_group: {topk_group} must be in 1..n_group ({num_expert_group})")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..{num_experts}")
    scores = torch.sigmoid(router_logits.float())
    biased = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group > 1 and topk_group < num_expert_group:
        per_group = num_experts // num_expert_group
        grouped = biased.view(num_tokens, num_expert_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        biased = biased.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids
