"""``tokenmill serve --speculative-config``: the official client gets the same greedy text as from a server
without speculation, streaming works, and ``/metrics`` counts drafts proposed and accepted."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.entrypoints.conftest import REAL_SERVED_NAME, RealServer, serve_default_model
from tests.entrypoints.helpers import metric

pytestmark = pytest.mark.slow

PROMPT = ("Repeat the following text exactly: The river bends twice before it reaches the old mill, and each bend "
          "hides a small beach of grey stones.\nText: The river bends")


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    yield from serve_default_model(tmp_path_factory, ("--speculative-config", spec))


def client(server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_same_text_streaming_and_metrics(spec_server: RealServer, real_server: RealServer) -> None:
    kw = dict(model=REAL_SERVED_NAME, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    plain = client(real_server).completions.create(**kw).choices[0].text
    spec = client(spec_server).completions.create(**kw)
    assert spec.choices[0].text == plain
    assert spec.usage is not None and spec.usage.completion_tokens == 24
    streamed = "".join(c.choices[0].text for c in client(spec_server).completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == plain
    text = httpx.get(spec_server.url + "/metrics").text
    drafted = metric(text, "tokenmill:spec_decode_num_draft_tokens_total", REAL_SERVED_NAME)
    accepted = metric(text, "tokenmill:spec_decode_num_accepted_tokens_total", REAL_SERVED_NAME)
    assert drafted > 0 and 0 < accepted <= drafted
    assert metric(text, "tokenmill:spec_decode_num_drafts_total", REAL_SERVED_NAME) > 0


def test_bad_speculative_config_stops_the_server_with_the_reason(tmp_path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 0}'],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "num_speculative_tokens" in proc.stderr + proc.stdout
