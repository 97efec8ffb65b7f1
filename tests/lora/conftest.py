"""Fixtures of the LoRA tests: a tiny Llama with the byte-level tokenizer and three PEFT adapters for it."""

from __future__ import annotations

import pytest

from tests.conftest import build_tiny_llama
from tests.engine.tiny_model import tiny_llama_with_tokenizer
from tests.lora.adapters import ALL_LLAMA_TARGETS, make_peft_adapter


@pytest.fixture(scope="session")
def lora_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("lora_llama")
    weights = build_tiny_llama(str(root / "weights"), seed=5)
    return tiny_llama_with_tokenizer(weights, root / "model")


@pytest.fixture(scope="session")
def llama_adapters(lora_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``a1``: every projection, rank 8; ``a2``: q/v only, rank 4 with rsLoRA scaling; ``a3``: the MLP only,
    rank 6 with an alpha pattern."""
    root = tmp_path_factory.mktemp("llama_adapters")
    return {
        "a1": make_peft_adapter(lora_llama_dir, str(root / "a1"), ALL_LLAMA_TARGETS, r=8, seed=1),
        "a2": make_peft_adapter(lora_llama_dir, str(root / "a2"), ["q_proj", "v_proj"], r=4, lora_alpha=8,
                                seed=2, use_rslora=True),
        "a3": make_peft_adapter(lora_llama_dir, str(root / "a3"), ["gate_proj", "up_proj", "down_proj"], r=6,
                                lora_alpha=12, seed=3, alpha_pattern={"down_proj": 3}),
    }


@pytest.fixture(scope="session")
def family_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where tiny family models are built (tests/models/families.py reuses one per family per session)."""
    return str(tmp_path_factory.mktemp("lora_families"))
