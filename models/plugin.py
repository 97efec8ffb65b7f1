"""Registers tokenmill's built-in architectures (entry point ``builtin_models`` in group ``tokenmill.plugins``).

Built-in models use the same hook a third-party model package would.
"""

from __future__ import annotations

from typing import Any

from tokenmill.plugins import hookimpl

BUILTIN_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "tokenmill.models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "tokenmill.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "tokenmill.models.qwen3:Qwen3ForCausalLM",
    "Gemma2ForCausalLM": "tokenmill.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "tokenmill.models.gemma3:Gemma3ForCausalLM",
    "Phi3ForCausalLM": "tokenmill.models.phi3:Phi3ForCausalLM",
    "GraniteForCausalLM": "tokenmill.models.granite:GraniteForCausalLM",
    "Olmo2ForCausalLM": "tokenmill.models.olmo2:Olmo2ForCausalLM",
    "MixtralForCausalLM": "tokenmill.models.mixtral:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "tokenmill.models.qwen3_moe:Qwen3MoeForCausalLM",
    # vision-language models (docs/multimodal.md)
    "LlavaForConditionalGeneration": "tokenmill.models.llava:LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration": "tokenmill.models.llava_next:LlavaNextForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "tokenmill.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "tokenmill.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
    "Idefics3ForConditionalGeneration": "tokenmill.models.idefics3:Idefics3ForConditionalGeneration",
    "Gemma3ForConditionalGeneration": "tokenmill.models.gemma3_mm:Gemma3ForConditionalGeneration",
    # hybrid attention / state-space models (docs/models.md)
    "Mamba2ForCausalLM": "tokenmill.models.mamba2:Mamba2ForCausalLM",
    "GraniteMoeHybridForCausalLM": "tokenmill.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
    "FalconH1ForCausalLM": "tokenmill.models.falcon_h1:FalconH1ForCausalLM",
    "Qwen3NextForCausalLM": "tokenmill.models.qwen3_next:Qwen3NextForCausalLM",
    "NemotronHForCausalLM": "tokenmill.models.nemotron_h:NemotronHForCausalLM",
    "JambaForCausalLM": "tokenmill.models.jamba:JambaForCausalLM",
    # pooling models (docs/pooling.md)
    "Qwen3Model": "tokenmill.models.pooling_adapters:Qwen3Model",
    "Qwen2Model": "tokenmill.models.pooling_adapters:Qwen2Model",
    "LlamaModel": "tokenmill.models.pooling_adapters:LlamaModel",
    "Qwen3ForSequenceClassification": "tokenmill.models.pooling_adapters:Qwen3ForSequenceClassification",
    "Qwen2ForSequenceClassification": "tokenmill.models.pooling_adapters:Qwen2ForSequenceClassification",
    "LlamaForSequenceClassification": "tokenmill.models.pooling_adapters:LlamaForSequenceClassification",
    "BertModel": "tokenmill.models.bert:BertModel",
    "XLMRobertaModel": "tokenmill.models.bert:XLMRobertaModel",
    "BertForSequenceClassification": "tokenmill.models.bert:BertForSequenceClassification",
    "XLMRobertaForSequenceClassification": "tokenmill.models.bert:XLMRobertaForSequenceClassification",
}


@hookimpl
def tokenmill_register_models(registry: Any) -> None:
    for arch, path in BUILTIN_MODELS.items():
        registry.register_model(arch, path)
