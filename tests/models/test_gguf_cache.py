"""A GGUF file's config and tensor table are read once and come back from the disk cache unchanged."""

from __future__ import annotations

import os

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


def _count_readers(monkeypatch) -> list[str]:
    import gguf

    opened: list[str] = []
    original = gguf.GGUFReader

    class CountingReader(original):  # type: ignore[misc, valid-type]
        def __init__(self, p, mode="r"):
            opened.append(str(p))
            super().__init__(p, mode)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    return opened


@pytest.mark.slow
def test_a_first_read_walks_the_file_once_for_config_tensors_and_tokenizer(default_model_path, tmp_path,
                                                                          monkeypatch):
    import gguf

    from tokenmill import tokenizer as tokenizer_module

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_module, "_CACHE", {})
    opened = _count_readers(monkeypatch)
    counting = gguf.GGUFReader
    directory, name = os.path.dirname(default_model_path), os.path.basename(default_model_path)
    config = load_hf_config(directory, name, gguf_tokenizer=True)
    assert opened == [default_model_path]
    assert gguf.GGUFReader is counting  # restored after the block
    entry = gguf_cache.gguf_cache_dir(default_model_path)
    assert (entry / "config" / "config.json").is_file()
    assert (entry / "tensors" / "tensors.json").is_file()
    assert (entry / "tokenizer" / "tokenizer_config.json").is_file()
    assert config.architectures == ["LlamaForCausalLM"]
    tokenizer = tokenizer_module.load_tokenizer(directory, name)  # the one prepared with the config
    assert tokenizer.decode(tokenizer.encode("The capital of France")) == "The capital of France"
    gguf_cache.read_gguf_tensors(default_model_path)
    monkeypatch.setattr(tokenizer_module, "_CACHE", {})
    assert load_hf_config(directory, name, gguf_tokenizer=True).to_dict() == config.to_dict()
    assert opened == [default_model_path]  # everything came from the cache


def test_a_tokenizer_that_cannot_be_converted_leaves_the_config_read_alone(tmp_path, monkeypatch):
    spec, arch = CASES[1]
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = build_family(spec, str(tmp_path / spec.name), seed=3)
    path = write_gguf(model_dir, str(tmp_path / "m.gguf"), arch, name=spec.name)  # a vocabulary without merges
    opened = _count_readers(monkeypatch)
    assert load_hf_config(str(tmp_path), "m.gguf", gguf_tokenizer=True).architectures == [spec.model_cls]
    assert opened == [path]
    assert (gguf_cache.gguf_cache_dir(path) / "tensors" / "tensors.json").is_file()


def test_reused_readers_are_one_per_file_and_only_inside_the_block(tmp_path, monkeypatch):
    import gguf

    spec, arch = CASES[1]
    model_dir = build_family(spec, str(tmp_path / spec.name), seed=3)
    first = write_gguf(model_dir, str(tmp_path / "a.gguf"), arch, name=spec.name)
    second = write_gguf(model_dir, str(tmp_path / "b.gguf"), arch, name=spec.name)
    original = gguf.GGUFReader
    with gguf_cache.reuse_gguf_readers():
        a = gguf.GGUFReader(first)
        with gguf_cache.reuse_gguf_readers():
            assert gguf.GGUFReader(first) is a
        assert gguf.GGUFReader(first) is a
        b = gguf.GGUFReader(second)
        assert b is not a and [t.name for t in b.tensors] == [t.name for t in a.tensors]
        assert gguf.GGUFReader(first, "c") is not a  # a copy-on-write reader is never shared
    assert gguf.GGUFReader is original
    assert gguf.GGUFReader(first) is not a
