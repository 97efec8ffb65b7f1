"""``tokenmill bench``: the commands run end to end at tiny shapes and their JSON is complete and consistent.

A copy of the tiny random Llama gets a word-level tokenizer covering its whole vocabulary (512 ids), so the
engine can load it; figures are not checked (these are not timed tests), only that they exist and add up.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenmill.entrypoints.bench.common import allowed_token_ids, random_prompts, summarize
from tokenmill.entrypoints.cli import main

VOCAB = 512
ENGINE_FLAGS = ["--max-model-len", "64", "--num-gpu-blocks-override", "64", "--block-size", "4"]


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _word_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("bench_model") / "tiny"
    shutil.copytree(tiny_llama_dir, path)
    _word_level_tokenizer().save_pretrained(str(path))
    return str(path)


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_random_prompts_exact_length_seeded_and_never_special() -> None:
    tok = _word_level_tokenizer()
    prompts = random_prompts(tok, 6, 50, seed=3)
    assert [len(p) for p in prompts] == [50] * 6
    assert prompts == random_prompts(tok, 6, 50, seed=3)
    assert prompts != random_prompts(tok, 6, 50, seed=4)
    assert not {0, 1, 2} & {t for p in prompts for t in p}
    assert max(allowed_token_ids(tok, vocab_size=100)) == 99


def test_summarize_percentiles() -> None:
    s = summarize([float(x) for x in range(1, 101)])
    assert s["mean"] == pytest.approx(50.5) and s["p50"] == pytest.approx(50.5)
    assert s["p99"] == pytest.approx(99.01)
    assert summarize([])["p99"] is None


def test_throughput_with_hf_baseline_writes_consistent_json(model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--model", model_dir, "--num-prompts", "4", "--input-len", "8",
               "--output-len", "4", "--warmup-prompts", "2", "--baseline", "hf", "--hf-batch-size", "3",
               "--json", str(out), "--disable-tqdm", *ENGINE_FLAGS])
    assert rc == 0
    r = _read(out)
    assert r["benchmark"] == "throughput" and r["date"] and "bench" in r["command"]
    for key in ("cpu_count", "usable_cores", "cpu_model", "ram_bytes", "torch_version", "torch_threads"):
        assert key in r["machine"]
    assert r["dtype"] in ("float32", "bfloat16", "float16") and r["model"]
    tm = r["tokenmill"]
    assert tm["num_requests"] == 4 and tm["input_tokens"] == 32 and tm["output_tokens"] == 16
    assert tm["output_tokens_per_s"] == pytest.approx(16 / tm["elapsed_s"])
    assert tm["total_tokens_per_s"] == pytest.approx(48 / tm["elapsed_s"])
    if os.path.exists("/proc/stat"):  # the hypervisor's share of the run, from /proc/stat
        assert 0 <= tm["cpu_steal_s"] <= tm["elapsed_s"] * (os.cpu_count() or 1)
    base = r["baseline"]
    assert set(base["dtypes"]) == {"float32", "bfloat16"} and base["best_dtype"] in base["dtypes"]
    assert all(d["output_tokens"] == 16 for d in base["dtypes"].values())
    assert base["output_tokens_per_s"] == max(d["output_tokens_per_s"] for d in base["dtypes"].values())
    assert r["ratio_output_tokens_per_s"] == pytest.approx(tm["output_tokens_per_s"] / base["output_tokens_per_s"])
    assert r["peak_rss_bytes"] > 0


def test_latency_with_hf_baseline(model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", model_dir, "--input-len", "8", "--output-len", "5",
               "--num-iters", "2", "--baseline", "hf", "--hf-dtypes", "float32", "--json", str(out),
               *ENGINE_FLAGS])
    assert rc == 0
    r = _read(out)
    for fig in (r["tokenmill"], r["baseline"]):
        assert fig["num_iters"] == 2 and len(fig["runs"]) == 2
        assert fig["ttft_s"] > 0 and fig["decode_tokens_per_s"] > 0
        assert fig["prefill_tokens_per_s"] == pytest.approx(8 / fig["ttft_s"])
    assert r["ratio_decode_tokens_per_s"] == pytest.approx(
        r["tokenmill"]["decode_tokens_per_s"] / r["baseline"]["decode_tokens_per_s"])


def test_latency_llamacpp_baseline_says_why_it_cannot_run(model_dir: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", model_dir, "--input-len", "4", "--output-len", "2",
               "--num-iters", "1", "--num-iters-warmup", "0", "--baseline", "llamacpp", "--json", str(out),
               *ENGINE_FLAGS])
    assert rc == 0
    base = _read(out)["baseline"]
    assert base["available"] is False
    if importlib.util.find_spec("llama_cpp") is None:
        assert "pip install llama-cpp-python" in base["reason"]
    else:
        assert "GGUF" in base["reason"]  # a Hugging Face directory cannot be given to llama.cpp
    assert base["reason"] in capsys.readouterr().out


def test_sweep_and_plot(model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    rc = main(["bench", "sweep", "--model", model_dir, "--batch-sizes", "1,3", "--input-len", "6",
               "--output-len", "5", "--json", str(out), *ENGINE_FLAGS])
    assert rc == 0
    r = _read(out)
    assert [p["batch_size"] for p in r["sweep"]] == [1, 3]
    for p in r["sweep"]:
        assert p["output_tokens"] == p["batch_size"] * 5
        assert p["decode_steps"] >= 1 and p["mean_step_s"] > 0 and p["mean_core_step_s"] > 0
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib not installed (pip install -e '.[bench]')")
    spec = importlib.util.spec_from_file_location(
        "bench_plot", Path(__file__).resolve().parents[2] / "benchmarks" / "plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    assert plot.main([str(out), "--out-dir", str(tmp_path / "png")]) == 0
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == [
        "sweep_step_time_vs_running.png", "sweep_throughput_vs_batch.png"]


@contextlib.contextmanager
def _fake_server() -> Iterator[str]:
    """The fake-engine OpenAI app under uvicorn on 127.0.0.1 (a free port), in a thread."""
    import uvicorn
    from tokenmill.entrypoints.openai.api_server import build_app

    from tests.entrypoints.fake_engine import FakeAsyncLLM, server_args

    engine = FakeAsyncLLM(delay_s=0.002)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, server_args()), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_serve_against_fake_server(model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    out = tmp_path / "serve.json"
    with _fake_server() as url:
        rc = main(["bench", "serve", "--base-url", url, "--tokenizer", model_dir, "--num-prompts", "6",
                   "--max-concurrency", "2", "--request-rate", "50", "--input-len", "8", "--output-len", "6",
                   "--json", str(out), "--disable-tqdm"])
    assert rc == 0
    r = _read(out)
    assert r["successful_requests"] == 6 and r["failed_requests"] == 0 and r["output_len_mismatches"] == 0
    assert r["total_input_tokens"] == 48 and r["total_output_tokens"] == 36
    assert r["model"] == "fake-org/fake-model"
    assert r["output_throughput"] == pytest.approx(36 / r["duration_s"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        assert r[key]["p50"] > 0 and r[key]["p99"] >= r[key]["p50"]
    assert r["e2e_latency_ms"]["mean"] >= r["ttft_ms"]["mean"]


def test_serve_counts_failed_requests(model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    port = free_port()  # nothing listens there
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer", model_dir,
               "--num-prompts", "2", "--max-concurrency", "2", "--input-len", "2", "--output-len", "2",
               "--json", str(out), "--disable-tqdm"])
    assert rc == 1
    r = _read(out)
    assert r["successful_requests"] == 0 and r["failed_requests"] == 2 and r["errors"]
