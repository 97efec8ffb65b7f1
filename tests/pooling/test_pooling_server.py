"""The pooling routes against a real ``tokenmill serve`` of a Qwen3-Embedding-style checkpoint (a causal LM
shipped with a sentence-transformers layout: the pooling runner is chosen with no flags, and it can still
generate): the openai client's embeddings (float and base64), /score, /rerank, errors, and embeddings mixed
with generation leaving no KV blocks in use."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.entrypoints.conftest import RealServer, run_server
from tests.entrypoints.helpers import assert_error, metric

NAME = "emb"


@pytest.fixture(scope="module")
def server(qwen3_embedder_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    yield from run_server(str(tmp_path_factory.mktemp("pool_server")),
                          [qwen3_embedder_dir, "--served-model-name", NAME, "--dtype", "float32",
                           "--max-num-batched-tokens", "32", "--kv-cache-memory", "64MiB", "--block-size", "4"])


@pytest.fixture(scope="module")
def reference(qwen3_embedder_dir: str):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(qwen3_embedder_dir, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(qwen3_embedder_dir)

    def embed(text: str) -> torch.Tensor:
        with torch.no_grad():
            return F.normalize(model(torch.tensor([tok.encode(text)])).last_hidden_state[0, -1], dim=-1)

    return embed


TEXTS = ["a tokenizer splits text", "hello world", "the weather is fine today, and tomorrow it will rain again"]


def test_openai_client_embeddings_float_and_base64(server: RealServer, reference) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    floats = client.embeddings.create(model=NAME, input=TEXTS)
    assert [d.index for d in floats.data] == [0, 1, 2]
    for d, text in zip(floats.data, TEXTS):
        torch.testing.assert_close(torch.tensor(d.embedding), reference(text), atol=1e-5, rtol=1e-4)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    # the client asks for base64 by default when it is given no encoding_format and decodes it itself
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"model": NAME, "input": TEXTS[0],
                                                           "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(decoded.copy()), reference(TEXTS[0]), atol=1e-5, rtol=1e-4)
    short = client.embeddings.create(model=NAME, input=[[5, 6, 7]], dimensions=32, encoding_format="float")
    assert len(short.data[0].embedding) == 32


def test_score_and_rerank_with_a_bi_encoder(server: RealServer, reference) -> None:
    query = "what does a tokenizer do"
    score = httpx.post(f"{server.url}/score", json={"model": NAME, "text_1": query, "text_2": TEXTS}).json()
    expected = [float(F.cosine_similarity(reference(query), reference(t), dim=0)) for t in TEXTS]
    assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=1e-5)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = httpx.post(f"{server.url}{path}", json={"model": NAME, "query": query, "documents": TEXTS,
                                                       "top_n": 2}).json()
        order = sorted(range(len(TEXTS)), key=lambda i: -expected[i])[:2]
        assert [r["index"] for r in body["results"]] == order
        assert body["results"][0]["document"]["text"] == TEXTS[order[0]]
        assert body["results"][0]["relevance_score"] == pytest.approx(expected[order[0]], abs=1e-5)


def test_pooling_errors(server: RealServer) -> None:
    url = server.url
    too_long = list(range(3, 3 + 400)) * 2
    assert_error(httpx.post(f"{url}/v1/embeddings", json={"model": NAME, "input": too_long}), 400, "input")
    ok = httpx.post(f"{url}/v1/embeddings", json={"model": NAME, "input": too_long, "truncate_prompt_tokens": 10})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 10
    assert_error(httpx.post(f"{url}/v1/embeddings", json={"model": NAME, "input": "x", "dimensions": 48}), 400,
                 "dimensions")
    assert_error(httpx.post(f"{url}/classify", json={"model": NAME, "input": "x"}), 400, "model")
    assert_error(httpx.post(f"{url}/score", json={"model": NAME, "text_1": ["a", "b"], "text_2": ["c"] * 3}), 400,
                 "text_2")


def test_concurrent_embeddings_mixed_with_generation_leave_no_blocks(server: RealServer, reference) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            jobs = []
            for i in range(64):
                jobs.append(client.post(f"{server.url}/v1/embeddings",
                                        json={"model": NAME, "input": TEXTS[i % 3], "encoding_format": "float"}))
                if i % 8 == 0:
                    jobs.append(client.post(f"{server.url}/v1/completions",
                                            json={"model": NAME, "prompt": TEXTS[i % 3], "max_tokens": 5,
                                                  "temperature": 0}))
            return await asyncio.gather(*jobs)

    responses = asyncio.run(run())
    embeddings = [r.json() for r in responses if r.json().get("object") == "list"]
    assert len(embeddings) == 64 and all(r.status_code == 200 for r in responses)
    refs = [reference(t) for t in TEXTS]
    for i, body in enumerate(embeddings):
        torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), refs[i % 3], atol=1e-5, rtol=1e-4)
    completions = [r.json() for r in responses if r.json().get("object") == "text_completion"]
    assert len(completions) == 8 and all(c["usage"]["completion_tokens"] == 5 for c in completions)
    text = httpx.get(f"{server.url}/metrics").text
    assert metric(text, "tokenmill:kv_cache_usage_perc", NAME) == 0


def test_chat_messages_embeddings_use_the_chat_template(server: RealServer, reference,
                                                        qwen3_embedder_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_embedder_dir)
    messages = [{"role": "system", "content": "Represent the question for retrieval"},
                {"role": "user", "content": "what does a tokenizer do"}]
    for add_generation_prompt in (False, True):
        body = {"model": NAME, "messages": messages, "encoding_format": "float"}
        if add_generation_prompt:
            body["add_generation_prompt"] = True
        r = httpx.post(f"{server.url}/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert text.startswith("<|im_start|>system\nRepresent") and text.endswith(
            "<|im_start|>assistant\n" if add_generation_prompt else "<|im_end|>\n")
        got = r.json()
        torch.testing.assert_close(torch.tensor(got["data"][0]["embedding"]), reference(text), atol=1e-5, rtol=1e-4)
        assert got["usage"]["prompt_tokens"] == len(tok.encode(text))
    assert_error(httpx.post(f"{server.url}/v1/embeddings", json={"model": NAME, "messages": []}), 400, "messages")
