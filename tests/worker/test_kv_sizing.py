"""KV-cache sizing: the Platform base's formula over device facts, and the profiled forward pass accelerators
size the cache after (peak activation memory left out, as vLLM does)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
from tokenmill.platforms import Platform

GiB = 1 << 30


def _config(**cache: Any) -> EngineConfig:
    return EngineConfig(model_config=ModelConfig(model="m", tokenizer="m", hf_config=None),
                        cache_config=CacheConfig(**cache))


class TotalDevice(Platform):
    name = "fake-gpu"
    device_type = "cpu"  # tensors on the host; the memory facts below are a fake 80 GiB device

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return 80 * GiB


class SharedMemory(Platform):
    name = "fake-host"
    memory_accounting = "available"
    kv_cache_available_fraction = 0.5
    kv_cache_cap_bytes = 8 * GiB

    @classmethod
    def get_device_available_memory(cls, device_id: int = 0) -> int:
        return 10 * GiB


def test_total_accounting_subtracts_weights_and_activations() -> None:
    config = _config(gpu_memory_utilization=0.5)
    assert TotalDevice.determine_kv_cache_bytes(config, model_memory_bytes=10 * GiB,
                                                peak_activation_bytes=GiB) == 29 * GiB
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        TotalDevice.determine_kv_cache_bytes(config, model_memory_bytes=40 * GiB)
    assert TotalDevice.determine_kv_cache_bytes(_config(kv_cache_memory=12345)) == 12345
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        TotalDevice.determine_kv_cache_bytes(_config(kv_cache_memory=-1))


def test_available_accounting_and_cap() -> None:
    assert SharedMemory.determine_kv_cache_bytes(_config(), model_memory_bytes=50 * GiB) == 5 * GiB  # weights are
    assert SharedMemory.determine_kv_cache_bytes(_config(), peak_activation_bytes=GiB) == 4 * GiB  # already out
    with pytest.raises(ValueError, match="activations peak"):
        SharedMemory.determine_kv_cache_bytes(_config(), peak_activation_bytes=6 * GiB)

    class Capped(SharedMemory):
        kv_cache_cap_bytes = GiB

    assert Capped.determine_kv_cache_bytes(_config()) == GiB


class ProfiledPlatform(Platform):
    """A CPU stand-in for an accelerator whose allocator reports a peak: the fake peak is the allocation before
    the profile run plus 10 bytes per token the profiled forward pass saw."""

    name = "fake-profiled"
    forward_tokens: ClassVar[list[int]] = []
    seen: ClassVar[dict[str, int]] = {}

    @classmethod
    def supports_memory_profiling(cls) -> bool:
        return True

    @classmethod
    def reset_peak_memory_stats(cls) -> None:
        cls.forward_tokens.clear()

    @classmethod
    def get_current_memory_bytes(cls) -> int:
        return 1000

    @classmethod
    def get_peak_memory_bytes(cls) -> int:
        return 1000 + 10 * sum(cls.forward_tokens)

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def determine_kv_cache_bytes(cls, config: Any, *, model_memory_bytes: int = 0, peak_activation_bytes: int = 0) -> int:
        cls.seen.update(model=model_memory_bytes, peak=peak_activation_bytes)
        return 64 * 1024 * 1024


def test_worker_sizes_the_cache_after_a_profiled_forward_pass(tiny_llama_dir: str) -> None:
    from tokenmill.engine_args import EngineArgs
    from tokenmill.platforms import get_current_platform, set_current_platform
    from tokenmill.worker.worker import Worker

    previous = get_current_platform()
    set_current_platform(ProfiledPlatform)
    try:
        config = EngineArgs(model=tiny_llama_dir, dtype="float32", max_num_batched_tokens=96,
                            max_num_seqs=8).create_engine_config()
        worker = Worker(config)
        worker.init_device()
        worker.load_model()
        model = worker.model_runner.model
        original = model.forward

        def counting(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            ProfiledPlatform.forward_tokens.append(int(input_ids.shape[0]))
            return original(input_ids, positions)

        model.forward = counting
        blocks = worker.determine_num_available_blocks()
    finally:
        set_current_platform(previous)
    assert ProfiledPlatform.forward_tokens == [96]  # one forward pass of a full step's token budget
    assert ProfiledPlatform.seen == {"model": worker.model_runner.model_memory_bytes(), "peak": 960}
    assert blocks == 64 * 1024 * 1024 // worker.model_runner.kv_cache_bytes_per_block()
