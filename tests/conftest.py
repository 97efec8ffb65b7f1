"""Shared fixtures: tiny random-weight Llama models built with transformers in a temp dir."""

from __future__ import annotations

import os
import sys
import tempfile

# Triton kernels (the CUDA and ROCm platforms' backend, and the conformance kit's emulated devices) are tested under
# the interpreter, on CPU tensors: TRITON_INTERPRET must be set before the process first imports triton, which
# compiling a graph does, so it is set here, before any test module is collected.
if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Engines built by tests (and the servers they start, which inherit the environment) stay eager: compiling
# decode steps takes seconds per engine. tests/worker/test_compiled_runner.py turns it back on.
os.environ["TOKENMILL_COMPILE"] = "0"
# Nor do they fault in their KV caches ahead of use (a background thread per engine, gigabytes of RAM for the
# default cache size); tests/plugins/test_builtin_platforms.py turns it on for its own caches.
os.environ["TOKENMILL_CPU_PREFAULT"] = "0"
# tokenmill's on-disk caches (compiled graphs, converted GGUF tokenizers) go to a directory of this test run,
# never the user's ~/.cache; servers the tests start inherit it, so a GGUF tokenizer is converted once per run.
os.environ.setdefault("TOKENMILL_CACHE_DIR", tempfile.mkdtemp(prefix="tokenmill-test-cache-"))
# So do Inductor's (compiled kernels, FX graphs): a run then pays what a fresh machine pays (CI), instead of reusing
# kernels that earlier runs left in the machine-wide /tmp/torchinductor_<user>.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.environ["TOKENMILL_CACHE_DIR"], "inductor"))


@pytest.hookimpl(trylast=True)  # after ``-k``/``-m`` deselection: only checks that will run count
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests import kernel_prebuild

    kernel_prebuild.start(items)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests import kernel_prebuild

    kernel_prebuild.stop()
    if "tests.lower_isa" in sys.modules:
        sys.modules["tests.lower_isa"].close_worker()


# The shape of every tiny test model (tests/models/families.py builds the other families on it too).
TINY_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)


def build_tiny_llama(path: str, *, seed: int = 0, tie: bool = False, **overrides) -> str:
    """Save a random-weight LlamaForCausalLM (a few layers, GQA) in Hugging Face layout under ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = {**TINY_CONFIG, "tie_word_embeddings": tie, **overrides}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from tokenmill.model_loader.default_model import DefaultModelMissingError, default_model_path

    try:
        return default_model_path()
    except DefaultModelMissingError as exc:
        pytest.skip(str(exc))
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_model_path: str):
    """transformers' tokenizer of the embedded default model, read from its GGUF once per test session (the
    GGUF vocabulary conversion takes seconds)."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(default_model_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def hf_default_model(default_model_path: str):
    """transformers' float32 copy of the embedded default model, dequantized from its GGUF once per test session
    (tens of seconds). Shared: a test that changes it works on ``copy.deepcopy`` of it."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(default_model_path)
    from tokenmill.model_loader.gguf_cache import reuse_gguf_readers

    # transformers reads the file's metadata twice (config, weights) and builds gguf's (pure) tensor-name map
    # once per tensor: seconds of the load, done once here.
    with pytest.MonkeyPatch.context() as patch, reuse_gguf_readers():
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, **load_kwargs) -> list[list[int]]:
    """Greedy continuation of each prompt with transformers' own ``generate`` (one prompt at a time)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load_kwargs).eval()
    outs = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
        )
        outs.append(ids[0, len(p) :].tolist())
    return outs


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
