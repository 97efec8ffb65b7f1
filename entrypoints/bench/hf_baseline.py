"""The Hugging Face transformers baseline: ``generate()`` on the same weights and the same prompts.

A GGUF model is loaded with ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` (transformers
dequantizes it; this needs the ``gguf`` and ``accelerate`` packages). Every run is greedy and produces exactly
the requested number of tokens (``min_new_tokens == max_new_tokens``), so the work matches tokenmill's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tokenmill.config import DTYPE_NAMES

def parse_dtypes(text: str) -> list[str]:
    """``"float32,bfloat16"`` -> ``["float32", "bfloat16"]`` (each checked)."""
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPE_NAMES]
    if not dtypes or bad:
        raise ValueError(f"--hf-dtypes: expected a comma-separated list of {', '.join(DTYPE_NAMES)}; got {text!r}")
    return dtypes


def load_hf_model(model: str | None) -> tuple[Any, Any]:
    """``(model, generation_ids)`` for tokenmill's MODEL argument, in float32, in eval mode.

    ``generation_ids`` holds ``pad_token_id`` and ``eos_token_id`` for generate.

    Raises:
        ImportError: the GGUF path needs ``accelerate``/``gguf`` (the message says what to install).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill.model_loader.hf_config import resolve_model_location

    loc = resolve_model_location(model)
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if loc.gguf_file is not None:
        kwargs["gguf_file"] = loc.gguf_file
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(loc.directory, **kwargs).eval()
    except ImportError as exc:
        raise ImportError(f"--baseline hf: transformers could not load {loc.path!r} ({exc}); "
                          "install the extras with: pip install accelerate gguf") from exc
    config = hf_model.config
    eos = getattr(hf_model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    pad = getattr(hf_model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(config, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if isinstance(eos, list) and eos else (eos if eos is not None else 0)
    return hf_model, {"pad_token_id": int(pad), "eos_token_id": eos}


def _generation_config(output_len: int, ids: dict[str, Any]) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=False,
        max_new_tokens=output_len,
        min_new_tokens=output_len,  # EOS is suppressed until output_len tokens: exactly output_len each
        pad_token_id=ids["pad_token_id"],
        eos_token_id=ids["eos_token_id"],
        use_cache=True,
    )


def left_pad(batch: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any]:
    """``(input_ids, attention_mask)`` int64 tensors of shape ``[len(batch), longest]``, padded on the left."""
    import torch

    longest = max(len(p) for p in batch)
    input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, prompt in enumerate(batch):
        if prompt:
            input_ids[row, longest - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, longest - len(prompt):] = 1
    return input_ids, mask


def hf_throughput(
    hf_model: Any,
    ids: dict[str, Any],
    prompts: Sequence[Sequence[int]],
    output_len: int,
    batch_size: int,
    warmup_prompts: Sequence[Sequence[int]],
) -> dict[str, Any]:
    """Generate ``output_len`` tokens for every prompt, ``batch_size`` prompts per ``generate`` call.

    Returns elapsed seconds (after a warm-up on ``warmup_prompts``), requests/s, output and total tokens/s.

    Raises:
        RuntimeError: a sequence came back with a different number of new tokens.
    """
    import torch

    with torch.inference_mode():
        if warmup_prompts:
            input_ids, mask = left_pad(warmup_prompts, ids["pad_token_id"])
            hf_model.generate(input_ids=input_ids, attention_mask=mask,
                              generation_config=_generation_config(min(output_len, 4), ids))
        output_tokens = 0
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            input_ids, mask = left_pad(batch, ids["pad_token_id"])
            out = hf_model.generate(input_ids=input_ids, attention_mask=mask,
                                    generation_config=_generation_config(output_len, ids))
            new = out.shape[1] - input_ids.shape[1]
            if new != output_len:
                raise RuntimeError(f"transformers generated {new} tokens per sequence, expected {output_len}")
            output_tokens += new * len(batch)
        elapsed = time.perf_counter() - start
    input_tokens = sum(len(p) for p in prompts)
    return {
        "elapsed_s": elapsed,
        "num_requests": len(prompts),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed,
    }


class _TimingStreamer:
    """A generate() streamer that records when each new token arrives (``time.perf_counter()``, seconds).

    ``generate`` first puts the prompt, then each new token; only the latter are recorded.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_latency_run(hf_model: Any, ids: dict[str, Any], prompt: Sequence[int], output_len: int) -> dict[str, float]:
    """One request alone: ``ttft_s`` (seconds from the call to the first new token) and ``decode_tokens_per_s``
    (``(output_len - 1) / (t_last - t_first)``; ``None`` when ``output_len == 1``)."""
    import torch

    streamer = _TimingStreamer()
    input_ids, mask = left_pad([prompt], ids["pad_token_id"])
    with torch.inference_mode():
        start = time.perf_counter()
        hf_model.generate(input_ids=input_ids, attention_mask=mask, streamer=streamer,
                          generation_config=_generation_config(output_len, ids))
    return latency_from_times(start, streamer.times, output_len)


def latency_from_times(start: float, token_times: Sequence[float], output_len: int) -> dict[str, Any]:
    """TTFT and decode rate from the arrival times of each generated token (seconds, same clock as start).

    Raises:
        RuntimeError: not exactly ``output_len`` token times.
    """
    if len(token_times) != output_len:
        raise RuntimeError(f"expected {output_len} generated tokens, got {len(token_times)}")
    ttft = token_times[0] - start
    decode_s = token_times[-1] - token_times[0]
    decode_rate = (output_len - 1) / decode_s if output_len > 1 and decode_s > 0 else None
    return {"ttft_s": ttft, "decode_s": decode_s, "decode_tokens_per_s": decode_rate,
            "e2e_s": token_times[-1] - start}
