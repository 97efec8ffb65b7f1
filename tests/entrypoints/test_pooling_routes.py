"""The pooling routes on a generation model: a 400 naming the runner (the fake engine runs ``generate``)."""

from __future__ import annotations

import pytest

from tests.entrypoints.helpers import assert_error


@pytest.mark.parametrize("path,body", [
    ("/v1/embeddings", {"input": "hello"}),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "hello"}]}),
    ("/classify", {"input": ["a", "b"]}),
    ("/score", {"text_1": "a", "text_2": ["b", "c"]}),
    ("/rerank", {"query": "a", "documents": ["b"]}),
    ("/v2/rerank", {"query": "a", "documents": ["b"]}),
])
def test_pooling_routes_on_a_generation_model_name_the_runner(client, path, body) -> None:
    error = assert_error(client.post(path, json=body), 400, "model")
    assert "'generate' runner" in error["message"]


def test_embedding_request_fields_are_checked(client) -> None:
    assert_error(client.post("/v1/embeddings", json={"input": "x", "encoding_format": "int8"}), 400,
                 "encoding_format")
    assert_error(client.post("/v1/embeddings", json={"input": "x", "bogus": 1}), 400, "bogus")
