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
