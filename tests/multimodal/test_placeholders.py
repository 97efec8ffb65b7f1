"""Placeholder ranges whose images take only some of their positions (vLLM's ``is_embed``): found in the
processor's token ids, and the embedding rows a prefill chunk writes (docs/multimodal.md)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.multimodal.inputs import MultiModalFeature, PlaceholderRange
from tokenmill.multimodal.processing import find_placeholders
from tokenmill.worker.encoder_runner import EncoderRunner

I = 7  # image token id


def test_find_placeholders_contiguous_and_interleaved():
    # image 0: one run of 3; image 1: two runs of 2 with two text tokens between (tiles), then text
    ids = [1, I, I, I, 2, 5, I, I, 3, 4, I, I, 5, 6]
    first, second = find_placeholders(ids, I, [3, 4])
    assert first == PlaceholderRange(1, 3) and first.is_embed is None and first.num_embeds == 3
    assert (second.offset, second.length) == (6, 6)
    assert second.is_embed == (True, True, False, False, True, True)
    assert second.num_embeds == 4
    with pytest.raises(ValueError, match="image tokens"):
        find_placeholders(ids, I, [3, 3])


def test_is_embed_must_cover_the_range():
    with pytest.raises(ValueError, match="is_embed"):
        PlaceholderRange(0, 3, (True, False))


def test_embeds_in_a_chunk():
    r = PlaceholderRange(10, 6, (True, True, False, False, True, True))
    assert r.embeds_in(0, 10) == (0, [])
    assert r.embeds_in(11, 15) == (1, [11, 14])  # row 1 at 11, positions 12-13 are text, row 2 at 14
    assert r.embeds_in(12, 14) == (2, [])
    assert r.embeds_in(0, 100) == (0, [10, 11, 14, 15])
    assert PlaceholderRange(10, 4).embeds_in(12, 20) == (2, [12, 13])


class _Embedder(torch.nn.Module):
    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids.float().unsqueeze(-1).repeat(1, 2)


def test_encoder_runner_writes_rows_only_at_embedding_positions():
    from types import SimpleNamespace

    runner = EncoderRunner(_Embedder(), torch.device("cpu"))
    feature = MultiModalFeature("image", "h", PlaceholderRange(1, 5, (True, False, False, True, True)), {})
    runner.encoder_cache["h"] = torch.tensor([[100.0, 100.0], [101.0, 101.0], [102.0, 102.0]])
    state = SimpleNamespace(mm_features=[feature], num_computed_tokens=2)  # this chunk: prompt positions 2..5
    ids = torch.tensor([30, 40, 50, 60])
    out = runner.input_embeddings(ids, [state], [4], [0, 4])
    assert out[:, 0].tolist() == [30.0, 40.0, 101.0, 102.0]  # positions 2, 3 text; 4, 5 image rows 1, 2


def test_embed_runs_are_the_maximal_runs_of_embedding_positions():
    assert PlaceholderRange(3, 4).embed_runs() == [(3, 7)]
    mask = (True, True, False, True, False, False, True)
    assert PlaceholderRange(10, 7, mask).embed_runs() == [(10, 12), (13, 14), (16, 17)]
