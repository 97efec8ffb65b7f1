"""``tokenmill serve DIR`` for two of the new families (a dense one with soft caps and sliding windows, and a
mixture-of-experts one), driven by the official ``openai`` client: the completion text equals the offline
``LLM``'s for the same prompt, whose tokens equal transformers' greedy ones."""

from __future__ import annotations

import contextlib

import openai
import pytest

from tests.entrypoints.conftest import run_server
from tests.models.families import family_dir
from tests.models.test_families import hf_reference
from tokenmill.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PROMPTS = ["Hello world, this is a test", "The quick brown fox"]
MAX_TOKENS = 12


@pytest.mark.parametrize("name", ["gemma2", "qwen3_moe"])
def test_serve_family_through_the_openai_api(name, family_root, tmp_path):
    from tokenmill.entrypoints.llm import LLM

    model_dir = family_dir(name, family_root)
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="64MiB", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.llm_engine.shutdown()
    greedy, _ = hf_reference(model_dir, [list(o.prompt_token_ids) for o in offline], MAX_TOKENS)
    assert [list(o.outputs[0].token_ids) for o in offline] == greedy

    args = [model_dir, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "64MiB",
            "--served-model-name", f"tiny-{name}"]
    with contextlib.contextmanager(run_server)(str(tmp_path), args) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [f"tiny-{name}"]
        for prompt, expected in zip(PROMPTS, offline):
            out = client.completions.create(model=f"tiny-{name}", prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0, extra_body={"ignore_eos": True})
            assert expected.outputs[0].text and out.choices[0].text == expected.outputs[0].text
            assert out.usage.completion_tokens == MAX_TOKENS
