"""The llama.cpp baseline (through the ``llama-cpp-python`` package) on the same GGUF file and thread count."""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from typing import Any

from tokenmill.entrypoints.bench.hf_baseline import latency_from_times

INSTALL_HINT = "install it with: pip install llama-cpp-python (it compiles llama.cpp; several minutes)"


def llamacpp_unavailable_reason(model: str | None) -> str | None:
    """Why the llama.cpp baseline cannot run for tokenmill's MODEL argument, or ``None`` when it can."""
    from tokenmill.model_loader.hf_config import resolve_model_location

    try:
        importlib.import_module("llama_cpp")
    except ImportError as exc:
        return f"llama-cpp-python is not installed ({exc}); {INSTALL_HINT}"
    except Exception as exc:  # noqa: BLE001 - a broken build fails in many ways; report it
        return f"llama-cpp-python is installed but failed to import ({type(exc).__name__}: {exc})"
    loc = resolve_model_location(model)
    if loc.gguf_file is None:
        return f"the llama.cpp baseline needs a GGUF model file, but {loc.path!r} is a Hugging Face directory"
    return None


class LlamaCppRunner:
    """One ``llama_cpp.Llama`` on a GGUF file.

    Args:
        gguf_path: the model file.
        n_threads: threads for both prompt processing and decoding (use tokenmill's count).
        n_ctx: context size in tokens (at least prompt + new tokens).
    """

    def __init__(self, gguf_path: str, n_threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.n_threads = n_threads
        self.llm = Llama(model_path=gguf_path, n_threads=n_threads, n_threads_batch=n_threads, n_ctx=n_ctx,
                         seed=0, verbose=False)
        self.version = getattr(importlib.import_module("llama_cpp"), "__version__", "unknown")

    def latency_run(self, prompt: Sequence[int], output_len: int) -> dict[str, Any]:
        """One request: TTFT (s) and decode tokens/s, greedy, EOS ignored (the same definitions as tokenmill's)."""
        self.llm.reset()  # forget the previous prompt: no prefix reuse between runs
        times: list[float] = []
        start = time.perf_counter()
        for _token in self.llm.generate(list(prompt), temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                        repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == output_len:
                break  # llama-cpp-python's generate() never stops by itself, so EOS is ignored
        return latency_from_times(start, times, output_len)
