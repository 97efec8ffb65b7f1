"""Test helpers for the engine front end: an offline tokenizer, fake EngineCores and a config.

The fake cores are importable by ``"module:Class"`` path, so a spawned engine-core process can build them.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
from tokenmill.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from tokenmill.errors import InvalidRequestError

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. STOP here. The end.",
    "Numbers 0123456789 and punctuation !?.,;:-_()[]{}",
    "naïve café résumé ÅÄÖ ß",
]
REJECT_TOKEN = 0  # a prompt starting with it is rejected by add_request (InvalidRequestError)
CRASH_TOKEN = 1  # a prompt starting with it makes step() raise


def byte_level_tokenizer() -> Any:
    """A small byte-level BPE tokenizer trained here (no files, no network); vocab ~400.

    Multi-byte characters (CJK, emoji) are split over several byte tokens. ``<eos>`` is id 2.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<reject>", "<crash>", "<eos>", "<special>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", additional_special_tokens=["<special>"])


def metaspace_tokenizer() -> Any:
    """A small SentencePiece-style (Metaspace, ``▁`` marks a space) BPE tokenizer trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>", unk_token="<unk>")


def make_config(vocab_size: int = 400, max_model_len: int = 256, eos_token_id: int = 2) -> EngineConfig:
    """An EngineConfig that needs no model files (for fake engine cores)."""
    hf_config = SimpleNamespace(vocab_size=vocab_size, eos_token_id=eos_token_id, num_hidden_layers=1)
    model_config = ModelConfig(model="fake", tokenizer="fake", hf_config=hf_config, max_model_len=max_model_len)
    return EngineConfig(model_config=model_config, cache_config=CacheConfig(block_size=16))


class EchoEngineCore:
    """Fake EngineCore: request ``r`` generates ``r.prompt_token_ids`` again, cyclically, one token per step.

    It honours max_tokens (LENGTH), EOS unless ignore_eos and stop_token_ids (STOP). A prompt starting with
    ``REJECT_TOKEN`` is rejected in ``add_request``; one starting with ``CRASH_TOKEN`` crashes ``step``.
    """

    step_delay_s = 0.0

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        config.cache_config.num_gpu_blocks = 64
        self.requests: dict[str, tuple[EngineCoreRequest, list[int]]] = {}
        self.aborted: list[str] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.prompt_token_ids[0] == REJECT_TOKEN:
            raise InvalidRequestError("prompt: rejected by the fake engine core", param="prompt")
        self.requests[request.request_id] = (request, [])

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def step(self) -> EngineCoreOutputs:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outputs = []
        for request_id, (request, generated) in list(self.requests.items()):
            prompt = request.prompt_token_ids
            if prompt[0] == CRASH_TOKEN:
                raise RuntimeError("fake engine core crashed in step")
            token = prompt[len(generated) % len(prompt)]
            generated.append(token)
            params = request.sampling_params
            finish, stop_reason = None, None
            if token == request.eos_token_id and not params.ignore_eos:
                finish = FinishReason.STOP
            elif token in params.stop_token_ids:
                finish, stop_reason = FinishReason.STOP, token
            elif params.max_tokens is not None and len(generated) >= params.max_tokens:
                finish = FinishReason.LENGTH
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=[token],
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    num_cached_tokens=len(prompt) // 2 if len(generated) == 1 else 0,
                )
            )
            if finish is not None:
                del self.requests[request_id]
        return EngineCoreOutputs(
            outputs=outputs, timestamp=time.monotonic(), scheduler_stats=self.get_stats()
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.requests))

    def reset_prefix_cache(self) -> bool:
        return True

    def get_aborted(self) -> list[str]:
        """Ids aborted so far (tests call it as a utility method)."""
        return list(self.aborted)

    def getenv(self, name: str) -> str | None:
        """The engine core process's environment variable ``name`` (a utility method)."""
        import os

        return os.environ.get(name)

    def shutdown(self) -> None:
        pass


class SlowEchoEngineCore(EchoEngineCore):
    """EchoEngineCore taking 20 ms per step (time to kill it mid-request)."""

    step_delay_s = 0.02


class FailingEngineCore:
    """Fake EngineCore whose construction fails, like a model that does not fit the device."""

    def __init__(self, config: EngineConfig) -> None:
        raise RuntimeError("fake startup failure: not enough memory for the KV cache")


def cls_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"
