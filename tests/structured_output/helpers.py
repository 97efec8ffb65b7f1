"""Helpers for the structured-output tests: a manager over the byte-level test tokenizer and a random walk that
samples only tokens the grammar allows."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import torch

from tests.engine.engine_fakes import byte_level_tokenizer
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, StructuredOutputsConfig
from tokenmill.structured_output.backend_types import StructuredOutputGrammar
from tokenmill.structured_output.manager import StructuredOutputManager

VOCAB = 512  # like the tiny Llama: the tokenizer has ~400 ids, the rest are never allowed
EOS = 2

_TOKENIZER: list[Any] = []


def tokenizer() -> Any:
    if not _TOKENIZER:
        _TOKENIZER.append(byte_level_tokenizer())
    return _TOKENIZER[0]


def make_config(backend: str = "auto", num_blocks: int = 64, block_size: int = 4, budget: int = 64,
                max_num_seqs: int = 8) -> EngineConfig:
    hf = SimpleNamespace(vocab_size=VOCAB, eos_token_id=EOS, num_hidden_layers=1)
    return EngineConfig(
        model_config=ModelConfig(model="fake", tokenizer="fake", hf_config=hf, max_model_len=512),
        cache_config=CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        structured_outputs_config=StructuredOutputsConfig(backend=backend),
    )


def make_manager(backend: str = "auto", config: EngineConfig | None = None) -> StructuredOutputManager:
    return StructuredOutputManager(config or make_config(backend), tokenizer=tokenizer(), max_workers=1)


def allowed_tokens(bitmask_row: torch.Tensor | Any, vocab: int = VOCAB) -> list[int]:
    row = torch.as_tensor(bitmask_row)
    return [t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1]


def pick(allowed: list[int], rng: random.Random) -> int:
    """EOS when the grammar allows it, else a random allowed token."""
    return EOS if EOS in allowed else rng.choice(allowed)


def random_walk(grammar: StructuredOutputGrammar, seed: int = 0, max_steps: int = 400) -> list[int]:
    """Tokens sampled at random among the allowed ones (EOS as soon as allowed) until the grammar terminates."""
    rng = random.Random(seed)
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    out: list[int] = []
    for _ in range(max_steps):
        if grammar.is_terminated():
            return out
        bitmask.fill_(-1)
        grammar.fill_bitmask(bitmask, 0)
        allowed = allowed_tokens(bitmask[0])
        assert allowed, f"grammar allows no token after {out}"
        token = pick(allowed, rng)
        assert grammar.accept_tokens("r", [token])
        out.append(token)
        if token == EOS:
            return out
    raise AssertionError(f"no termination within {max_steps} tokens: {tokenizer().decode(out)!r}")


def text_of(tokens: list[int]) -> str:
    return str(tokenizer().decode([t for t in tokens if t != EOS]))
