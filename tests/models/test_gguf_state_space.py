"""A Mamba2 written to GGUF as llama.cpp's converter writes a ``mamba2`` file, served from the file.

The tiny random checkpoint of ``test_hybrid_models.py`` (two Mamba2 layers, grouped ``B``/``C``, untied head) is
converted with the ``gguf`` package (``tests/models/gguf_writer.write_mamba2_gguf``: ``A = -exp(A_log)``,
squeezed conv weight, ``[groups, inner / groups]`` norm, the byte-level tokenizer as ``tokenizer.ggml.*``). The file
must give transformers' greedy tokens (24) and prompt logprobs on the original weights (float32), and its Q8_0
form must load exactly the Q8_0-rounded weights. Other llama.cpp state-space architectures are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.models.gguf_hybrid_writer import q8_0_rounded_copy
from tests.models.gguf_writer import write_mamba2_gguf
from tests.models.test_families import PROMPTS, check_against_transformers
from tests.models.test_hybrid_models import SPECS, build
from tokenmill.engine.core import EngineCore
from tokenmill.engine_args import EngineArgs

# short, mid-chunk and long (several 16-token prefill steps) prompts, one more than the two state slots
PROMPTS_HERE = [PROMPTS[0], PROMPTS[2], PROMPTS[5]]
# the tensors write_mamba2_gguf quantizes (2-D in llama.cpp's layout, rows of whole blocks, not the conv weight)
_QUANTIZED = ("in_proj.weight", "out_proj.weight", "embeddings.weight", "lm_head.weight", "mixer.norm.weight")


@pytest.fixture(scope="module")
def mamba2_dir(tmp_path_factory) -> str:
    return build(next(s for s in SPECS if s.name == "mamba2"), str(tmp_path_factory.mktemp("mamba2")))


def _engine(gguf_or_dir: str) -> EngineCore:
    config = EngineArgs(model=gguf_or_dir, dtype="float32", block_size=4, max_num_batched_tokens=16,
                        max_num_seqs=2, num_gpu_blocks_override=256).create_engine_config()
    assert config.model_config.architectures == ["Mamba2ForCausalLM"]
    return EngineCore(config)


def test_mamba2_gguf_matches_transformers_and_carries_the_tokenizer(mamba2_dir, tmp_path):
    from transformers import AutoTokenizer

    from tokenmill.tokenizer import load_tokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(mamba2_dir)
    (tmp_path / "f32").mkdir()  # no tokenizer files beside the GGUF: the vocabulary must come from the file
    path = write_mamba2_gguf(mamba2_dir, str(tmp_path / "f32" / "mamba2.gguf"), tokenizer=hf_tokenizer)
    check_against_transformers(_engine(path), mamba2_dir, PROMPTS_HERE)
    tokenizer = load_tokenizer(str(tmp_path / "f32"), "mamba2.gguf")
    text = "Hello there, the quick brown fox: 42 + 7"
    assert tokenizer(text).input_ids == hf_tokenizer(text).input_ids
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 2


def test_mamba2_q8_0_gguf_loads_the_q8_0_rounded_weights(mamba2_dir, tmp_path):
    """Every parameter loaded from the Q8_0 file equals the one loaded from the checkpoint whose weights went
    through the same Q8_0 round trip (the float32 file's outputs are checked above, so equal weights give
    equal outputs)."""
    import gguf

    path = write_mamba2_gguf(mamba2_dir, str(tmp_path / "mamba2-q8_0.gguf"), qtype=gguf.GGMLQuantizationType.Q8_0)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ssm_in.weight"] == types["blk.1.ssm_norm.weight"] == "Q8_0"
    assert types["blk.0.ssm_conv1d.weight"] == types["blk.0.ssm_a"] == "F32"
    rounded = q8_0_rounded_copy(mamba2_dir, str(tmp_path / "rounded"), lambda name: name.endswith(_QUANTIZED))
    check_q8_0_load(_engine, path, rounded, ["backbone.layers.0.mixer.out_proj", "lm_head"])


def check_q8_0_load(engine: Callable[[str], EngineCore], path: str, reference: str, quant_only: list[str],
                    **engine_args: Any) -> None:
    """Every parameter ``engine(path)`` (a Q8_0 file) loads equals the one ``engine(reference)`` (its checkpoint
    with the same Q8_0 round trip) loads, and with ``-q int8`` (``engine_args`` on top of float32, 4-token
    blocks) the modules ``quant_only`` keep the file's Q8_0 blocks (their rows are whole blocks)."""
    import torch

    params = []
    for source in (path, reference):
        core = engine(source)
        params.append({k: v.detach().clone() for k, v in core.executor.worker.model_runner.model.state_dict().items()})
        core.shutdown()
    config = EngineArgs(model=path, dtype="float32", block_size=4, num_gpu_blocks_override=64, quantization="int8",
                        **engine_args).create_engine_config()
    core = EngineCore(config)
    modules = dict(core.executor.worker.model_runner.model.named_modules())
    core.shutdown()
    assert all(modules[name].quant_only for name in quant_only)
    from_gguf, from_checkpoint = params
    assert from_gguf.keys() == from_checkpoint.keys()
    for name, want in from_checkpoint.items():
        # A_log comes back as log(-(-exp(A_log))): equal within float32 rounding
        torch.testing.assert_close(from_gguf[name], want, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("arch", ["jamba", "rwkv7"])
def test_gguf_of_an_unsupported_state_space_architecture_is_refused_by_name(arch, tmp_path):
    import gguf

    path = str(tmp_path / f"{arch}.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=rf"GGUF architecture '{arch}' is not supported.*mamba2.*qwen3"):
        EngineArgs(model=path, dtype="float32").create_engine_config()
