"""``tokenmill serve`` on the real Ray cluster of tests/executor (tests/ray_cluster.py), with the official
``openai`` client: data parallel with Ray-placed engine cores on two nodes (greedy text equal to the
single-process engine, ``/metrics`` per engine), a worker actor killed mid-generation (a clear error within
seconds, ``/health`` 503, exit 1), and no actor or placement group left behind after either exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.engine.tiny_model import tiny_llama_with_tokenizer
from tests.entrypoints.conftest import free_port, wait_healthy
from tests.entrypoints.helpers import metric
from tests.ray_cluster import alive_actors, live_placement_groups
from tokenmill.executor.ray_utils import BUNDLE_RESOURCES_ENV, RAY_NAMESPACE
from tokenmill.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [[1, 5, 9, 33, 44, 100], [7] * 13, [3, 4], list(range(20, 61)), [11, 300, 301, 302, 17], [9, 8, 7, 6]]
ENGINE_FLAGS = ["--dtype", "float32", "--block-size", "4", "--kv-cache-memory", "256KiB", "--max-model-len", "256"]
NAME = "tiny"


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory) -> str:
    return tiny_llama_with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("ray_serve") / "model")


@pytest.fixture(scope="module")
def reference_texts(model_dir) -> list[str]:
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(model=model_dir, dtype="float32", block_size=4, kv_cache_memory="256KiB", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [out.outputs[0].text for out in llm.generate(PROMPTS, params, use_tqdm=False)]


class Server:
    def __init__(self, model_dir: str, cluster, tmp_path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"serve-{self.port}.log"
        cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", model_dir, "--port", str(self.port),
               "--served-model-name", NAME, "--ray-address", cluster.address, *ENGINE_FLAGS, *flags]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**cluster.env, "TOKENIZERS_PARALLELISM": "false", **(env or {})})

    def log_tail(self, chars: int = 5000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        wait_healthy(self.url, self.process, self.log_tail, timeout_s)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode


def _nothing_left(timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not live_placement_groups() and not any(alive_actors(c) for c in ("EngineCoreActor", "RayWorkerWrapper")):
            return True
        time.sleep(0.5)
    return False


def test_serve_dp2_ray_engines_on_two_nodes(ray_cluster, model_dir, reference_texts, tmp_path):
    import openai

    server = Server(model_dir, ray_cluster, tmp_path, "--data-parallel-size", "2", "--data-parallel-backend", "ray",
                    env={BUNDLE_RESOURCES_ENV: json.dumps([{"node_a": 0.01}, {"node_b": 0.01}])})
    try:
        server.wait_healthy()
        nodes = ray_cluster.node_ids_by_resource()
        engines = sorted(alive_actors("EngineCoreActor"), key=lambda a: a.name)
        assert [a.node_id for a in engines] == [nodes["node_a"], nodes["node_b"]]
        assert all(a.namespace == RAY_NAMESPACE for a in engines)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")

        def complete(prompt: list[int]) -> str:
            out = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
            return out.choices[0].text

        results: list[str | None] = [None] * len(PROMPTS)
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(PROMPTS[i])))
                   for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == reference_texts
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        served = [metric(text, "tokenmill:generation_tokens_total", NAME, engine=e) for e in ("0", "1")]
        assert sum(served) == 8 * len(PROMPTS) and min(served) > 0, served  # both engines took requests
        assert metric(text, "tokenmill:kv_cache_usage_perc", NAME, engine="1") == 0.0
    finally:
        code = server.stop()
    assert code == 0, server.log_tail()
    assert _nothing_left(), "Ray actors or placement groups outlived the server"


def test_serve_tp2_ray_worker_killed_mid_generation(ray_cluster, model_dir, tmp_path):
    import ray

    server = Server(model_dir, ray_cluster, tmp_path, "--tensor-parallel-size", "2",
                    "--distributed-executor-backend", "ray")
    try:
        server.wait_healthy()
        body = {"model": NAME, "prompt": [5, 6, 7], "max_tokens": 240, "temperature": 0, "ignore_eos": True,
                "stream": True}
        events: list[str] = []
        first_chunk = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(120), server.log_tail()
        workers = alive_actors("RayWorkerWrapper")
        assert len(workers) == 2
        ray.kill(ray.get_actor(workers[1].name, namespace=RAY_NAMESPACE))
        killed = time.monotonic()
        reader.join(30)
        assert not reader.is_alive(), "the stream hung after the actor was killed"
        assert time.monotonic() - killed < 10.0
        errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
        assert errors and errors[0]["code"] == "engine_dead", events[-3:]
        assert "Ray worker actor" in server.log_tail(20000)  # the log names the cause
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 503
        server.process.wait(30)  # the server stops by itself
        assert server.process.returncode == 1
    finally:
        server.stop()
    assert _nothing_left(), "Ray actors or placement groups outlived the server"
