"""A GGUF file's config and tensor table are read once and come back from the disk cache unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from tests.models.families import BY_NAME, FamilySpec, build_family
from tests.models.gguf_writer import write_gguf
from tokenmill.model_loader import gguf_cache
from tokenmill.model_loader.hf_config import load_hf_config

# Phi-3 exercises the most fix-ups (partial rotary, LongRoPE factors from tensors); Mistral-as-llama the
# architecture rename.
CASES = [
    (FamilySpec("phi3", "Phi3Config", "Phi3ForCausalLM",
                {k: v for k, v in BY_NAME["phi3"].kwargs.items() if k != "sliding_window"}), "phi3"),
    (FamilySpec("mistral", "MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=None)), "llama"),
]


@pytest.mark.parametrize("spec,arch", CASES, ids=[c[0].name for c in CASES])
def test_config_and_tensors_from_the_cache_equal_a_fresh_read(spec, arch, tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = build_family(spec, str(tmp_path / spec.name), seed=3)
    path = write_gguf(model_dir, str(tmp_path / f"{spec.name}.gguf"), arch, name=spec.name)
    directory, name = str(tmp_path), f"{spec.name}.gguf"
    entry = gguf_cache.gguf_cache_dir(path)
    assert entry is not None and not entry.exists()

    fresh = load_hf_config(directory, name)
    assert (entry / "config" / "config.json").is_file()
    cached = load_hf_config(directory, name)
    assert type(cached) is type(fresh)
    assert cached.to_dict() == fresh.to_dict()
    assert cached.architectures == [spec.model_cls]

    arch_name, first = gguf_cache.read_gguf_tensors(path)
    assert (entry / "tensors" / "tensors.json").is_file()
    arch_again, again = gguf_cache.read_gguf_tensors(path)
    reader = gguf.GGUFReader(path)
    assert arch_name == arch_again == arch
    assert [t.name for t in first] == [t.name for t in again] == [t.name for t in reader.tensors]
    for ours, theirs in zip(again, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        np.testing.assert_array_equal(ours.data, theirs.data)


def test_a_damaged_cached_config_is_read_again_and_replaced(tmp_path, monkeypatch):
    spec, arch = CASES[1]
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = build_family(spec, str(tmp_path / spec.name), seed=3)
    path = write_gguf(model_dir, str(tmp_path / "m.gguf"), arch, name=spec.name)
    fresh = load_hf_config(str(tmp_path), "m.gguf")
    saved = gguf_cache.gguf_cache_dir(path) / "config" / "config.json"
    saved.write_text("{ not json")
    again = load_hf_config(str(tmp_path), "m.gguf")
    assert again.to_dict() == fresh.to_dict()
    assert load_hf_config(str(tmp_path), "m.gguf").to_dict() == fresh.to_dict()


def test_an_unwritable_cache_only_costs_time(tmp_path, monkeypatch):
    spec, arch = CASES[1]
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(blocker))
    model_dir = build_family(spec, str(tmp_path / spec.name), seed=3)
    path = write_gguf(model_dir, str(tmp_path / "m.gguf"), arch, name=spec.name)
    assert load_hf_config(str(tmp_path), "m.gguf").architectures == [spec.model_cls]
    assert [t.name for t in gguf_cache.read_gguf_tensors(path)[1]]
