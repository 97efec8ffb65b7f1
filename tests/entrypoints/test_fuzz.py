"""Fuzz: schemathesis generates requests from the server's own OpenAPI document (valid and invalid ones) and
sends them to the app over the fake engine; no request may get a 5xx.

The fake engine runs the server's whole request path (parsing, validation, templates, tokenization, the
msgpack encoding of sampling params the real ZMQ hop does), so what fails here would fail the real server.
Bounded: at most ``MAX_EXAMPLES`` examples per operation and mode, no shrinking, a fixed seed.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from tokenmill.entrypoints.openai.api_server import build_app  # noqa: E402

from tests.entrypoints.fake_engine import FakeAsyncLLM, server_args  # noqa: E402

MAX_EXAMPLES = 30

_engine = FakeAsyncLLM(max_model_len=512)
_app = build_app(_engine, server_args(api_key=None))
schema = schemathesis.openapi.from_asgi("/openapi.json", _app)
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                max_examples=MAX_EXAMPLES, no_shrink=True, deterministic=True)


@pytest.fixture(autouse=True)
def _no_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case) -> None:
    _engine.dead = False  # a fuzzed request can never kill the engine; keep the app serving
    case.call_and_validate(checks=[not_a_server_error])
