"""The built-in architecture list and the error for one that is not supported."""

from __future__ import annotations

import json

import pytest

from tests.conftest import build_tiny_llama
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs
from tokenmill.model_loader.registry import ModelRegistry, UnknownArchitectureError
from tokenmill.models.plugin import BUILTIN_MODELS

FAMILY_ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM",
                "Olmo2ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"]
# hybrid and attention-free models (state layers), tested in tests/models/test_hybrid_models.py
HYBRID_ARCHS = ["Mamba2ForCausalLM", "GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM", "Qwen3NextForCausalLM",
                "NemotronHForCausalLM", "JambaForCausalLM"]
# pooling models (docs/pooling.md), tested in tests/pooling
POOLING_ARCHS = ["Qwen3Model", "Qwen2Model", "LlamaModel", "Qwen3ForSequenceClassification",
                 "Qwen2ForSequenceClassification", "LlamaForSequenceClassification", "BertModel", "XLMRobertaModel",
                 "BertForSequenceClassification", "XLMRobertaForSequenceClassification"]
# vision-language models (docs/multimodal.md), tested in tests/models/test_vision_models.py
VISION_ARCHS = ["LlavaForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                "Qwen2_5_VLForConditionalGeneration", "Idefics3ForConditionalGeneration",
                "Gemma3ForConditionalGeneration", "LlavaNextForConditionalGeneration"]


def test_every_family_is_registered_through_the_entry_point_and_imports():
    assert sorted(BUILTIN_MODELS) == sorted(FAMILY_ARCHS + POOLING_ARCHS + VISION_ARCHS + HYBRID_ARCHS)
    for arch in FAMILY_ARCHS + POOLING_ARCHS + VISION_ARCHS + HYBRID_ARCHS:
        assert ModelRegistry.is_registered(arch)
        assert ModelRegistry.resolve_model_cls([arch]).__name__ == arch


def test_unsupported_architecture_gets_the_error_listing_the_known_ones(tmp_path):
    model_dir = build_tiny_llama(str(tmp_path / "odd"))
    with open(tmp_path / "odd" / "config.json") as f:
        config = json.load(f)
    config["architectures"] = ["FancyNewForCausalLM"]
    with open(tmp_path / "odd" / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(UnknownArchitectureError) as info:
        EngineCore(EngineArgs(model=model_dir, dtype="float32", num_gpu_blocks_override=16).create_engine_config())
    message = str(info.value)
    assert "['FancyNewForCausalLM'] are not supported" in message
    assert all(arch in message for arch in FAMILY_ARCHS)
    assert "tokenmill_register_models" in message
