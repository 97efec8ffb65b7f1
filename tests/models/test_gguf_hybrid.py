"""Granite 4.0-H, Falcon-H1 and Nemotron-H written to GGUF as llama.cpp's converter writes ``granitehybrid``,
``falcon-h1`` and ``nemotron_h`` / ``nemotron_h_moe`` files, served from the file.

The tiny random checkpoints of ``test_hybrid_models.py`` (Granite: Mamba2 and attention layers, 4 experts top-2
plus the shared MLP, Granite's multipliers; Falcon-H1: a mixer and attention in every layer, muP multipliers)
are converted with the ``gguf`` package (``tests/models/gguf_hybrid_writer.py``). A float32 file must give
transformers' greedy tokens (24) and prompt logprobs on the original weights; a Q8_0 file must load exactly the
weights of the checkpoint whose quantized tensors went through the same Q8_0 round trip. Nemotron-H's files hold
MLP layers (``nemotron_h``) or MoE layers (``nemotron_h_moe``), never both: each is checked on a variant of the
test's checkpoint with the other kind replaced.
"""

from __future__ import annotations

import gguf
import pytest

from tests.models.gguf_hybrid_writer import (
    falcon_h1_folded_copy,
    q8_0_rounded_copy,
    write_falcon_h1_gguf,
    write_granite_hybrid_gguf,
    write_nemotron_h_gguf,
)
from tests.models.test_families import PROMPTS, check_against_transformers
from tests.models.test_gguf_state_space import check_q8_0_load
from tests.models.test_hybrid_models import SPECS, build
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs

# prompts of 33, 2 and 40 tokens, run together (what is tested here is the file's weights and config; the
# scheduling cases are test_hybrid_models.py's)
PROMPTS_HERE = [PROMPTS[0], PROMPTS[2], PROMPTS[5]]
WRITERS = {"granitemoehybrid": write_granite_hybrid_gguf, "falcon_h1": write_falcon_h1_gguf}
ARCHITECTURES = {"granitemoehybrid": "GraniteMoeHybridForCausalLM", "falcon_h1": "FalconH1ForCausalLM"}


@pytest.fixture(scope="module", params=list(WRITERS))
def hybrid_dir(request, tmp_path_factory) -> tuple[str, str]:
    name = request.param
    return name, build(next(s for s in SPECS if s.name == name), str(tmp_path_factory.mktemp(name)))


def _engine(source: str, arch: str) -> EngineCore:
    config = EngineArgs(model=source, dtype="float32", block_size=4, max_num_batched_tokens=128, max_num_seqs=3,
                        max_model_len=256, num_gpu_blocks_override=256).create_engine_config()
    assert config.model_config.architectures == [arch]
    return EngineCore(config)


def test_hybrid_gguf_matches_transformers_and_carries_the_tokenizer(hybrid_dir, tmp_path):
    from transformers import AutoTokenizer

    from tokenmill.tokenizer import load_tokenizer

    name, model_dir = hybrid_dir
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # no tokenizer files beside the GGUF: the vocabulary must come from the file
    path, _ = WRITERS[name](model_dir, str(tmp_path / f"{name}.gguf"), tokenizer=hf_tokenizer)
    check_against_transformers(_engine(path, ARCHITECTURES[name]), model_dir, PROMPTS_HERE)
    text = "Hello there, the quick brown fox: 42 + 7"
    assert load_tokenizer(str(tmp_path), f"{name}.gguf")(text).input_ids == hf_tokenizer(text).input_ids


def test_hybrid_q8_0_gguf_loads_the_q8_0_rounded_weights(hybrid_dir, tmp_path):
    """Every parameter loaded from the Q8_0 file equals the one loaded from the checkpoint whose quantized
    tensors went through the same Q8_0 round trip (Falcon-H1: the checkpoint with the multipliers folded in, as
    the file holds them; the float32 file's outputs are checked above, so equal weights give equal outputs)."""
    name, model_dir = hybrid_dir
    path, quantized = WRITERS[name](model_dir, str(tmp_path / f"{name}-q8_0.gguf"),
                                    qtype=gguf.GGMLQuantizationType.Q8_0)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ssm_in.weight"] == types["blk.1.attn_k.weight"] == "Q8_0"
    assert types["blk.0.ssm_conv1d.weight"] == types["blk.0.ssm_a"] == "F32"
    reference = model_dir
    if name == "falcon_h1":
        reference = falcon_h1_folded_copy(model_dir, str(tmp_path / "folded"))
    reference = q8_0_rounded_copy(reference, str(tmp_path / "rounded"), quantized.__contains__)
    # with -q int8 the attention projections keep the file's Q8_0 blocks (q/k rows permuted back for Granite)
    check_q8_0_load(lambda source: _engine(source, ARCHITECTURES[name]), path, reference,
                    ["model.layers.1.self_attn.qkv_proj", "lm_head"], max_model_len=256)


def test_granitehybrid_gguf_with_partial_rotary_is_refused(tmp_path):
    """A ``granitehybrid`` file with RoPE over part of each head (llama.cpp writes Bamba files so) is refused
    with a clear error, not served with the wrong rotary."""
    import numpy as np

    path = str(tmp_path / "bamba.gguf")
    w = gguf.GGUFWriter(path, "granitehybrid")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(32)
    w.add_head_count(4)
    w.add_head_count_kv([0, 2])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(8)  # of 16 per head
    w.add_rope_scaling_finetuned(True)
    w.add_ssm_conv_kernel(4)
    w.add_ssm_state_size(16)
    w.add_ssm_inner_size(128)
    w.add_ssm_time_step_rank(8)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="RoPE over 8 of 16 dimensions per head"):
        EngineArgs(model=path, dtype="float32").create_engine_config()


def test_granitehybrid_gguf_without_experts_loads_the_q8_0_rounded_weights(tmp_path):
    """A Granite 4.0-H without experts (as Granite 4.0-H-Micro): the converter writes the shared MLP as
    ``ffn_gate`` / ``ffn_up`` / ``ffn_down``, and the file must load exactly the Q8_0-rounded checkpoint."""
    from dataclasses import replace

    spec = next(s for s in SPECS if s.name == "granitemoehybrid")
    model_dir = build(replace(spec, kwargs={**spec.kwargs, "num_local_experts": 0}), str(tmp_path / "dense"))
    path, quantized = write_granite_hybrid_gguf(model_dir, str(tmp_path / "dense-q8_0.gguf"),
                                                qtype=gguf.GGMLQuantizationType.Q8_0)
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.0.ffn_gate.weight" in names and not any("exps" in n or "shexp" in n for n in names)
    reference = q8_0_rounded_copy(model_dir, str(tmp_path / "rounded"), quantized.__contains__)
    check_q8_0_load(lambda source: _engine(source, "GraniteMoeHybridForCausalLM"), path, reference,
                    ["model.layers.0.shared_mlp.gate_up_proj"], max_model_len=256)


def _nemotron_h_variant(kind: str, path: str) -> str:
    """The test's Nemotron-H checkpoint with every ``mlp`` and ``moe`` layer of kind ``kind`` and one expert group
    (the converter writes ``expert_group_count`` but not how many groups stay eligible)."""
    from dataclasses import replace

    spec = next(s for s in SPECS if s.name == "nemotron_h")
    kinds = [kind if k in ("mlp", "moe") else k for k in spec.kwargs["layers_block_type"]]
    return build(replace(spec, kwargs={**spec.kwargs, "layers_block_type": kinds, "n_group": 1}), path)


@pytest.fixture(scope="module")
def nemotron_h_moe_dir(tmp_path_factory) -> str:
    return _nemotron_h_variant("moe", str(tmp_path_factory.mktemp("nemotron_h_moe")))


def test_nemotron_h_moe_gguf_matches_transformers(nemotron_h_moe_dir, tmp_path):
    """A ``nemotron_h_moe`` file (Mamba2, MoE with grouped sigmoid routing, a correction bias, a latent width and
    a shared expert, attention without RoPE) with its vocabulary: transformers' greedy tokens and logprobs."""
    from transformers import AutoTokenizer

    path, _ = write_nemotron_h_gguf(nemotron_h_moe_dir, str(tmp_path / "moe.gguf"),
                                    tokenizer=AutoTokenizer.from_pretrained(nemotron_h_moe_dir))
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "nemotron_h_moe"
    check_against_transformers(_engine(path, "NemotronHForCausalLM"), nemotron_h_moe_dir, PROMPTS_HERE)


def test_nemotron_h_moe_gguf_with_expert_groups_is_refused(nemotron_h_moe_dir, tmp_path):
    """Several expert groups: the file does not say how many stay eligible, so it is refused, not guessed."""
    import json
    import shutil

    grouped = shutil.copytree(nemotron_h_moe_dir, tmp_path / "grouped")
    config = json.loads((grouped / "config.json").read_text())
    (grouped / "config.json").write_text(json.dumps({**config, "n_group": 2, "topk_group": 1}))
    path, _ = write_nemotron_h_gguf(str(grouped), str(tmp_path / "grouped.gguf"))
    with pytest.raises(ValueError, match="2 expert groups but no expert_group_used_count"):
        EngineArgs(model=path, dtype="float32").create_engine_config()


def test_nemotron_h_gguf_with_mlp_layers_matches_transformers(tmp_path):
    model_dir = _nemotron_h_variant("mlp", str(tmp_path / "dense"))
    path, _ = write_nemotron_h_gguf(model_dir, str(tmp_path / "dense.gguf"))
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "nemotron_h"
    check_against_transformers(_engine(path, "NemotronHForCausalLM"), model_dir, PROMPTS_HERE)


def test_nemotron_h_moe_q8_0_gguf_loads_the_q8_0_rounded_weights(nemotron_h_moe_dir, tmp_path):
    """Every parameter from the Q8_0 file (experts stacked, q/k rows permuted back, the router float) equals the
    Q8_0-rounded checkpoint's."""
    path, quantized = write_nemotron_h_gguf(nemotron_h_moe_dir, str(tmp_path / "moe-q8_0.gguf"),
                                            qtype=gguf.GGMLQuantizationType.Q8_0)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.1.ffn_up_exps.weight"] == types["blk.2.attn_k.weight"] == "Q8_0"
    assert types["blk.1.ffn_gate_inp.weight"] == types["blk.1.exp_probs_b.bias"] == "F32"
    reference = q8_0_rounded_copy(nemotron_h_moe_dir, str(tmp_path / "rounded"), quantized.__contains__)
    check_q8_0_load(lambda source: _engine(source, "NemotronHForCausalLM"), path, reference,
                    ["model.layers.2.mixer.qkv_proj"], max_model_len=256)
