"""``tokenmill serve --enable-lora`` driven by the official ``openai`` client and httpx: adapters from
``--lora-modules`` and ``/v1/load_lora_adapter`` are listed by ``/v1/models`` with the base model as parent,
picked by ``model``, give the offline engine's text (whose tokens equal transformers + peft, see
test_lora_correctness.py), and unload / reload cleanly; bad adapters get a 400 with the reason, unknown ones a
404 naming the known ones, and no KV block is left in use."""

from __future__ import annotations

import contextlib

import httpx
import openai
import pytest

from tests.entrypoints.conftest import run_server
from tests.entrypoints.helpers import assert_error, metric
from tests.lora.adapters import make_peft_adapter
from tokenmill.entrypoints.llm import LLM
from tokenmill.lora import LoRARequest
from tokenmill.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

NAME = "tiny-base"
PROMPT = "Hello world, this is"
MAX_TOKENS = 8
ENGINE = dict(dtype="float32", max_model_len=256, max_loras=2, max_lora_rank=8)


def _offline_texts(model_dir: str, loras: dict[str, str]) -> dict[str | None, str]:
    llm = LLM(model_dir, enable_lora=True, kv_cache_memory="16MiB", **ENGINE)
    names = [None, *loras]
    reqs = [None, *(LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(loras.items()))]
    outs = llm.generate([PROMPT] * len(names), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False, lora_request=reqs)
    llm.llm_engine.shutdown()
    return {n: o.outputs[0].text for n, o in zip(names, outs)}


def test_load_use_unload_reload_through_the_server(lora_llama_dir, llama_adapters, tmp_path):
    big_rank = make_peft_adapter(lora_llama_dir, str(tmp_path / "r16"), ["q_proj"], r=16)
    expected = _offline_texts(lora_llama_dir, {k: llama_adapters[k] for k in ("a1", "a2", "a3")})
    assert len(set(expected.values())) == 4  # each adapter changes the text

    args = [lora_llama_dir, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
            "--served-model-name", NAME, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"a1={llama_adapters['a1']}"]
    with contextlib.contextmanager(run_server)(str(tmp_path), args) as server:
        url = server.url
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        http = httpx.Client(base_url=url, timeout=120)

        def complete(model: str) -> str:
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.model == model
            return out.choices[0].text

        def models() -> dict[str, openai.types.Model]:
            return {m.id: m for m in client.models.list().data}

        # --lora-modules: served at start-up, listed with its parent
        listed = models()
        assert list(listed) == [NAME, "a1"]
        assert listed["a1"].parent == NAME and listed["a1"].root == llama_adapters["a1"]
        assert complete("a1") == expected["a1"] and complete(NAME) == expected[None]

        # load at run time; use it in the same batch as another adapter and the base model (streamed too)
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": llama_adapters["a2"]})
        assert r.status_code == 200, r.text
        assert list(models()) == [NAME, "a1", "a2"]
        batch = client.completions.create(model="a2", prompt=[PROMPT] * 2, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert [c.text for c in batch.choices] == [expected["a2"]] * 2
        stream = client.completions.create(model="a1", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected["a1"]

        # errors: loaded twice, bad adapters (400 with the reason, nothing listed), missing fields
        assert "already been loaded" in assert_error(
            http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": llama_adapters["a3"]}),
            400, "lora_name")["message"]
        err = assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": big_rank}),
                           400, "lora_path")
        assert "rank 16" in err["message"] and "--max-lora-rank 8" in err["message"]
        err = assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "nope", "lora_path": "/no/such"}),
                           400, "lora_path")
        assert "not a directory" in err["message"]
        assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400, "lora_path")
        assert list(models()) == [NAME, "a1", "a2"]

        # unknown adapter: 404 naming the known models
        with pytest.raises(openai.NotFoundError) as info:
            complete("big")
        message = info.value.body["message"]
        assert "`big`" in message and f"`{NAME}`" in message and "`a1`" in message and "`a2`" in message

        # unload, then the name is unknown; unloading again is a 404
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
        assert list(models()) == [NAME, "a1"]
        with pytest.raises(openai.NotFoundError):
            complete("a2")
        assert "`a2`" in assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}), 404,
                                      "lora_name", "NotFoundError")["message"]

        # reload the name with another adapter: the new weights serve (no stale slot or prefix-cache blocks)
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": llama_adapters["a3"]})
        assert r.status_code == 200, r.text
        assert complete("a2") == expected["a3"]
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": llama_adapters["a2"]})
        assert r.status_code == 200, r.text
        assert complete("a3") == expected["a2"] and complete("a1") == expected["a1"]
        assert complete(NAME) == expected[None]

        text = http.get("/metrics").text
        assert metric(text, "tokenmill:kv_cache_usage_perc", NAME) == 0.0
        assert metric(text, "tokenmill:num_requests_running", NAME) == 0.0
