"""A GGUF file's converted tokenizer is saved once and loaded from the cache afterwards, unchanged."""

from __future__ import annotations

import os

import pytest

from tokenmill import tokenizer as tokenizer_module

TEXTS = ["The capital of France is Paris.", "  two  spaces\n\nünïcödé 你好 🤖", "<|im_start|>user\nhi<|im_end|>"]


@pytest.mark.slow
def test_gguf_tokenizer_is_cached_on_disk_and_loads_back_identical(default_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tokenizer_module, "_CACHE", {})
    directory, name = os.path.dirname(default_model_path), os.path.basename(default_model_path)
    converted = tokenizer_module.load_tokenizer(directory, name)
    saved = tokenizer_module._gguf_cache_dir(directory, name)
    assert saved is not None and (saved / "tokenizer_config.json").is_file()
    monkeypatch.setattr(tokenizer_module, "_CACHE", {})
    cached = tokenizer_module.load_tokenizer(directory, name)
    assert cached is not converted and type(cached) is type(converted)
    for text in TEXTS:
        ids = converted.encode(text)
        assert cached.encode(text) == ids
        assert cached.decode(ids, skip_special_tokens=True) == converted.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "Hi"}]
    assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        converted.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (cached.all_special_ids, cached.eos_token_id, len(cached)) == \
        (converted.all_special_ids, converted.eos_token_id, len(converted))


def test_a_changed_gguf_file_gets_a_new_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"one")
    first = tokenizer_module._gguf_cache_dir(str(tmp_path), "m.gguf")
    model.write_bytes(b"other")
    assert tokenizer_module._gguf_cache_dir(str(tmp_path), "m.gguf") != first
    assert tokenizer_module._gguf_cache_dir(str(tmp_path), "missing.gguf") is None
