"""The fused-experts op, its weight loading (per expert, fused 3-D, tensor-parallel shards) and the platform hook."""

from __future__ import annotations

import pytest
import torch

from tests.models.families import family_dir
from tests.models.test_families import PROMPTS, hf_reference, run_wave, tokens
from tokenmill.layers import FusedMoE, TorchFusedMoEMethod
from tokenmill.layers import fused_moe as fused_moe_module


def naive_moe(x, w13, w2, weights, ids):
    """Per token, per chosen expert, in float64: ``sum_j w_j * down(silu(gate(x)) * up(x))``."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    i = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            out[t] += weights[t, j].double() * (w2[e].double() @ (torch.nn.functional.silu(h[:i]) * h[i:]))
    return out


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped-mm", "loop-over-experts"])
def test_torch_method_matches_per_token_reference(grouped_mm, monkeypatch):
    if not grouped_mm:
        monkeypatch.setattr(fused_moe_module, "_GROUPED_MM_UNSUPPORTED", {("cpu", torch.float32)})
    g = torch.Generator().manual_seed(0)
    t, h, i, e, k = 13, 32, 24, 6, 2
    x = torch.randn(t, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
    ids = torch.randint(0, e - 1, (t, k), generator=g)  # expert e - 1 gets no token
    ids[:, 1] = (ids[:, 0] + 1) % (e - 1)
    weights = torch.rand(t, k, generator=g)
    out = TorchFusedMoEMethod().apply(x, w13, w2, weights, ids, "silu")
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), naive_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    assert TorchFusedMoEMethod().apply(x[:0], w13, w2, weights[:0], ids[:0], "silu").shape == (0, h)


def test_routing_softmax_topk_with_and_without_renormalisation():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    probs = torch.softmax(logits, -1)
    for renorm in (True, False):
        layer = FusedMoE(4, 2, 8, 4, renormalize=renorm)
        w, ids = layer.select_experts(logits)
        assert ids.tolist() == [[1, 2]]
        expected = probs[0, [1, 2]] / (probs[0, [1, 2]].sum() if renorm else 1.0)
        torch.testing.assert_close(w[0], expected)


def _expert_weights(e: int, h: int, i: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g), torch.randn(e, h, i, generator=g)


def test_checkpoint_layouts_load_the_same_parameters():
    from tokenmill.model_loader.weight_utils import load_checkpoint_weights

    e, h, i = 3, 8, 6
    gate, up, down = _expert_weights(e, h, i)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Module()
            self.mlp.experts = FusedMoE(e, 2, h, i)

    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    per_expert = [(f"mlp.experts.{x}.{n}.weight", t[x]) for x in range(e)
                  for n, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))]
    fused = [("mlp.experts.gate_up_proj", torch.cat((gate, up), dim=1)), ("mlp.experts.down_proj", down)]
    gguf_style = [("mlp.experts.gate_proj", gate), ("mlp.experts.up_proj", up), ("mlp.experts.down_proj", down)]
    params = []
    for weights in (per_expert, fused, gguf_style):
        m = Holder()
        loaded = load_checkpoint_weights(m, weights, expert_weight_names=names)
        assert loaded == {"mlp.experts.w13_weight", "mlp.experts.w2_weight"}
        params.append((m.mlp.experts.w13_weight.clone(), m.mlp.experts.w2_weight.clone()))
    for w13, w2 in params[1:]:
        assert torch.equal(w13, params[0][0]) and torch.equal(w2, params[0][1])
    assert torch.equal(params[0][0][:, :i], gate) and torch.equal(params[0][0][:, i:], up)
    # One expert missing: the parameter does not count as loaded (the loader reports it missing).
    partial = load_checkpoint_weights(Holder(), per_expert[:-3], expert_weight_names=names)
    assert partial == set()


def test_expert_and_fused_linear_shards_per_tensor_parallel_rank(monkeypatch):
    """Each rank of TP 2 holds half of every expert's intermediate columns; a fused qkv / gate_up checkpoint is
    split into its parts before sharding (Phi-3)."""
    import tokenmill.distributed as dist
    from tokenmill.layers import MergedColumnParallelLinear, QKVParallelLinear

    e, h, i = 2, 8, 6
    gate, up, down = _expert_weights(e, h, i, seed=1)
    qkv_full = torch.randn((4 + 2 * 2) * 4, h)  # 4 query heads, 2 kv heads, head size 4
    gate_up_full = torch.randn(2 * 10, h)
    for rank in (0, 1):
        monkeypatch.setattr(dist, "_TP", dist.GroupCoordinator([0, 1], rank))  # rank of 2, no collectives run
        moe = FusedMoE(e, 1, h, i)
        moe.weight_loader(moe.w13_weight, torch.cat((gate, up), dim=1), "w13")
        moe.weight_loader(moe.w2_weight, down, "w2")
        half = slice(rank * 3, rank * 3 + 3)
        assert torch.equal(moe.w13_weight, torch.cat((gate[:, half], up[:, half]), dim=1))
        assert torch.equal(moe.w2_weight, down[:, :, half])
        qkv = QKVParallelLinear(h, 4, 4, 2)
        qkv.weight_loader(qkv.weight, qkv_full)
        q, k, v = qkv_full.split([16, 8, 8])
        assert torch.equal(qkv.weight, torch.cat((q[rank * 8 : rank * 8 + 8], k[rank * 4 : rank * 4 + 4],
                                                  v[rank * 4 : rank * 4 + 4])))
        merged = MergedColumnParallelLinear(h, [10, 10])
        merged.weight_loader(merged.weight, gate_up_full)
        g_, u_ = gate_up_full.split([10, 10])
        assert torch.equal(merged.weight, torch.cat((g_[rank * 5 : rank * 5 + 5], u_[rank * 5 : rank * 5 + 5])))


class RecordingMoEMethod(TorchFusedMoEMethod):
    """A platform's own fused-experts kernel (here: the torch one, counting its calls)."""

    calls = 0

    def apply(self, *args, **kwargs):
        type(self).calls += 1
        return super().apply(*args, **kwargs)


def test_platform_hook_supplies_the_fused_moe_kernel(family_root):
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine_args import EngineArgs
    from tokenmill.platforms import get_current_platform
    from tokenmill.platforms.current import set_current_platform
    from tokenmill.sampling_params import SamplingParams

    base = get_current_platform()
    path = f"{__name__}:RecordingMoEMethod"

    class MoEKernelPlatform(base):  # type: ignore[misc, valid-type]
        @classmethod
        def get_fused_moe_cls(cls) -> str:
            return path

    model_dir = family_dir("mixtral", family_root)
    set_current_platform(MoEKernelPlatform)
    try:
        core = EngineCore(EngineArgs(model=model_dir, dtype="float32", num_gpu_blocks_override=128)
                          .create_engine_config())
        layers = [m for m in core.executor.worker.model_runner.model.modules() if isinstance(m, FusedMoE)]
        assert layers and all(m.method_path == path for m in layers)
        RecordingMoEMethod.calls = 0
        outs = run_wave(core, "k", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finally:
        set_current_platform(base)
    assert RecordingMoEMethod.calls >= 2 * 6  # every MoE layer of every step
    greedy, _ = hf_reference(model_dir, PROMPTS, 6)
    assert [tokens(outs[i]) for i in range(len(PROMPTS))] == greedy


def test_quantization_leaves_routers_and_experts_full_precision(family_root):
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine_args import EngineArgs
    from tokenmill.layers import SparseMoeBlock
    from tokenmill.sampling_params import SamplingParams

    core = EngineCore(EngineArgs(model=family_dir("qwen3_moe", family_root), dtype="float32", quantization="int8",
                                 num_gpu_blocks_override=64).create_engine_config())
    model = core.executor.worker.model_runner.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.gate.quant is None for b in blocks)
    assert model.model.layers[0].self_attn.qkv_proj.quant is not None  # the rest is quantized
    outs = run_wave(core, "q", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(tokens(o)) == 4 for o in outs.values())
