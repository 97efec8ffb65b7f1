"""Rotary tables of every rope type against transformers' own rotary embedding modules."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_of

HEAD = 16


def _ours(config, max_position: int) -> RotaryEmbedding:
    return get_rope(HEAD, max_position, config)


def _hf_rows(rotary, config, positions: list[int], one_at_a_time: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin ``[len(positions), rot/2]``; with ``one_at_a_time`` each position is its own forward
    pass (as in decoding, where dynamic / LongRoPE frequencies follow the current length)."""
    x = torch.zeros(1, 1, HEAD)
    if not one_at_a_time:
        cos, sin = rotary(x, torch.tensor([positions]))
        half = cos.shape[-1] // 2
        return cos[0, :, :half], sin[0, :, :half]
    rows = [rotary(x, torch.tensor([[p]])) for p in positions]
    half = rows[0][0].shape[-1] // 2
    return torch.cat([c[0, :, :half] for c, _ in rows]), torch.cat([s[0, :, :half] for _, s in rows])


LLAMA_ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 0.9,
                    "mscale_all_dim": 0.7, "beta_fast": 16, "beta_slow": 2},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
}


@pytest.mark.parametrize("name", list(LLAMA_ROPES))
def test_rope_types_match_transformers(name):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {**LLAMA_ROPES[name], "rope_theta": 5000.0}
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=32, rope_parameters=params)
    ours = _ours(config, 96)
    positions = list(range(96))
    # dynamic NTK depends on the current length: compare position by position, as decoding sees it
    cos, sin = _hf_rows(LlamaRotaryEmbedding(config), config, positions, one_at_a_time=name == "dynamic")
    torch.testing.assert_close(ours.cos_cache[:96], cos, rtol=0, atol=2e-5)
    torch.testing.assert_close(ours.sin_cache[:96], sin, rtol=0, atol=2e-5)
    if name != "default":
        assert not torch.allclose(ours.cos_cache, _ours(LlamaConfig(hidden_size=64, num_attention_heads=4,
                                                                    max_position_embeddings=32,
                                                                    rope_theta=5000.0), 96).cos_cache)


def test_longrope_and_partial_rotary_match_transformers():
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                        original_max_position_embeddings=32, pad_token_id=0,
                        rope_parameters={"rope_type": "longrope", "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                                         "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [1.0, 3.0, 9.0, 27.0]})
    ours = _ours(config, 64)
    assert ours.rotary_dim == 8
    cos, sin = _hf_rows(Phi3RotaryEmbedding(config), config, list(range(64)), one_at_a_time=True)
    torch.testing.assert_close(ours.cos_cache, cos, rtol=0, atol=2e-5)
    torch.testing.assert_close(ours.sin_cache, sin, rtol=0, atol=2e-5)


def test_partial_rotary_leaves_the_other_dims_alone_and_per_layer_parameters():
    from transformers import Gemma3TextConfig

    rope = RotaryEmbedding(8, 4, 16, 10000.0, None)
    q, k = torch.randn(3, 2 * 8), torch.randn(3, 8)
    rq, rk = rope(torch.tensor([0, 5, 9]), q, k)
    assert torch.equal(rq.view(3, 2, 8)[..., 4:], q.view(3, 2, 8)[..., 4:])
    assert torch.equal(rq[0], q[0]) and not torch.allclose(rk[1], k[1])
    cfg = Gemma3TextConfig(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1e6}})
    local, glob = rope_parameters_of(cfg, "sliding_attention"), rope_parameters_of(cfg, "full_attention")
    assert (local["rope_theta"], local["rope_type"]) == (10000.0, "default")
    assert (glob["rope_theta"], glob["rope_type"], glob["factor"]) == (1e6, "linear", 8.0)
    assert get_rope(16, 64, cfg, layer_type="sliding_attention") is not get_rope(16, 64, cfg,
                                                                                 layer_type="full_attention")


def test_unknown_rope_type_is_a_clear_error():
    with pytest.raises(ValueError, match="rope type 'wavy' is not supported"):
        RotaryEmbedding(8, 8, 4, 10000.0, {"rope_type": "wavy"})
    with pytest.raises(ValueError, match="needs 'factor'"):
        RotaryEmbedding(8, 8, 4, 10000.0, {"rope_type": "linear"})


def test_cos_sin_are_looked_up_per_forward_pass_not_kept_between_steps():
    rope = RotaryEmbedding(8, 8, 32, 10000.0, None)
    positions = torch.tensor([1, 2, 3])
    rope.begin_step(positions)
    q, k = torch.randn(3, 8), torch.randn(3, 8)
    first = rope(positions, q, k)
    rope.end_step()
    positions[:] = torch.tensor([7, 8, 9])  # same tensor object, new contents (as a captured graph's buffer)
    second = rope(positions, q, k)
    expected = RotaryEmbedding(8, 8, 32, 10000.0, None)(torch.tensor([7, 8, 9]), q, k)
    assert torch.equal(second[0], expected[0]) and not torch.equal(first[0], second[0])
