"""Fixtures: a second tiny random Llama with the target's vocabulary (a draft), and one with another vocabulary."""

from __future__ import annotations

import pytest

from tests.conftest import build_tiny_llama


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Another random model (other seed, one layer) over the same 512-token vocabulary."""
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny_draft")), seed=1, num_hidden_layers=1)


@pytest.fixture(scope="session")
def tiny_other_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny_vocab256")), seed=2, vocab_size=256)


@pytest.fixture(scope="session")
def peaked_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A 16-token target with peaked distributions, and a draft that is the target with a perturbed LM head
    (it agrees with the target about half the time)."""
    import torch
    from transformers import LlamaForCausalLM

    target = build_tiny_llama(str(tmp_path_factory.mktemp("peaked_target")), seed=3, vocab_size=16,
                              initializer_range=0.5)
    model = LlamaForCausalLM.from_pretrained(target)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.lm_head.weight.add_(0.3 * torch.randn(model.lm_head.weight.shape, generator=gen))
    draft = str(tmp_path_factory.mktemp("peaked_draft"))
    model.save_pretrained(draft)
    return target, draft
