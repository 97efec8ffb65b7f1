"""Build a tiny random checkpoint of the example architecture, and the plain Llama it is equivalent to.

transformers has no ``LayerScaleLlamaForCausalLM``, so the checkpoint starts as a ``LlamaForCausalLM`` saved
with ``save_pretrained``. Two things then need fixing by hand, which is the general recipe for a new
architecture's test checkpoint:

1. ``save_pretrained`` writes the class it saved into config.json (``"architectures": ["LlamaForCausalLM"]``):
   rewrite that entry to the new architecture's name, or tokenmill picks the built-in Llama.
2. Add the new tensors (here the gains) to the safetensors file.

The gains are powers of two and the output projections are divided by them, so the new model computes exactly
what the saved Llama computes: the Llama directory is the reference (transformers runs it) for tests.

    python make_test_checkpoint.py OUT_DIR  # writes OUT_DIR/layerscale and OUT_DIR/reference
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM


def build(out_dir: str, seed: int = 0) -> tuple[str, str]:
    """Returns ``(layerscale_dir, reference_dir)``."""
    out = Path(out_dir)
    reference, twist = out / "reference", out / "layerscale"
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(reference)
    LlamaForCausalLM(config).save_pretrained(twist)  # the directory layout, config and shard names
    tensors = load_file(str(reference / "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 1)
    choices = torch.tensor([0.5, 2.0, 4.0])
    for i in range(config.num_hidden_layers):
        for name, proj in (("attn_scale", "self_attn.o_proj"), ("mlp_scale", "mlp.down_proj")):
            gain = choices[torch.randint(0, 3, (config.hidden_size,), generator=g)]
            key = f"model.layers.{i}.{proj}.weight"
            tensors[key] = (tensors[key] / gain[:, None]).contiguous()  # exact: powers of two
            tensors[f"model.layers.{i}.{name}"] = gain
    save_file(tensors, str(twist / "model.safetensors"), metadata={"format": "pt"})
    cfg_path = twist / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["LayerScaleLlamaForCausalLM"]  # save_pretrained wrote "LlamaForCausalLM"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return str(twist), str(reference)


if __name__ == "__main__":
    print(*build(sys.argv[1] if len(sys.argv) > 1 else "layerscale-checkpoint"))
