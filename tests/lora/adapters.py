"""Helpers of the LoRA tests: PEFT adapters with random (non-zero) A and B on tiny models, and the reference
greedy tokens of transformers + peft for them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

ALL_LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(model_dir: str, out_dir: str, target_modules: Sequence[str] | str, *, r: int = 8,
                      lora_alpha: float = 16, seed: int = 0, std: float = 0.2, load_kwargs: dict | None = None,
                      **config) -> str:
    """Save a PEFT LoRA adapter for the model in ``model_dir`` under ``out_dir`` (safetensors).

    PEFT initialises ``lora_B`` to zeros (the adapter would change nothing), so every LoRA weight is drawn
    from ``N(0, std)`` instead.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **(load_kwargs or {}))
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=targets, lora_dropout=0.0,
                                            **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(model_dir: str, adapter_dir: str | None, prompts: Sequence[Sequence[int]],
                max_new_tokens: int, **load_kwargs) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, with the adapter applied by peft (``None``: base);
    ``load_kwargs`` go to ``from_pretrained`` (e.g. ``gguf_file``)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load_kwargs)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outs = []
    for p in prompts:
        ids = model.generate(torch.tensor([list(p)]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False)
        outs.append(ids[0, len(p):].tolist())
    return outs
