"""MambaManager (state slots) and HybridKVCacheCoordinator (state slots beside the KV blocks), without a model."""

from __future__ import annotations

import pytest

from tokenmill.core.kv_cache_coordinator import HybridKVCacheCoordinator
from tokenmill.core.request import Request
from tokenmill.core.state_cache_manager import MambaManager
from tokenmill.sampling_params import SamplingParams


def req(rid: str, n: int) -> Request:
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=4), eos_token_id=None, max_tokens=4)


def test_mamba_manager_hands_out_each_slot_once_and_reuses_freed_ones():
    m = MambaManager(2)
    assert m.allocate("a") == 0 and m.allocate("b") == 1
    assert m.allocate("a") == 0  # already holds one
    assert m.allocate("c") is None
    m.free("a")
    m.free("a")  # no slot: nothing happens
    assert m.allocate("c") == 0 and m.get_num_free_slots() == 0
    with pytest.raises(KeyError):
        m.get_slot("a")
    with pytest.raises(ValueError, match="num_state_slots"):
        MambaManager(0)


def test_coordinator_takes_blocks_and_slot_together_and_frees_both():
    kv = HybridKVCacheCoordinator(num_blocks=4, block_size=4, num_state_slots=2)
    a, b, c = req("a", 8), req("b", 6), req("c", 2)
    assert len(kv.allocate_slots(a, 8)) == 2 and kv.get_state_slot("a") == 0
    # b needs 2 blocks, 2 are free: it gets them and the last slot
    assert len(kv.allocate_slots(b, 6)) == 2 and kv.get_state_slot("b") == 1
    # c: no slot left -> nothing taken
    assert kv.allocate_slots(c, 2) is None and kv.get_state_slot("c") is None
    kv.free(b)
    assert kv.mamba_manager.get_num_free_slots() == 1 and kv.block_pool.get_num_free_blocks() == 2
    # a new request short of blocks gives its new slot back
    big = req("big", 16)
    assert kv.allocate_slots(big, 16) is None and kv.mamba_manager.get_num_free_slots() == 1
    kv.free(a)
    assert kv.block_pool.get_num_free_blocks() == 4 and kv.mamba_manager.get_num_free_slots() == 2
    assert not kv.enable_caching and kv.get_computed_blocks(a) == ([], 0)


def test_attention_free_coordinator_hands_out_no_blocks():
    kv = HybridKVCacheCoordinator(num_blocks=2, block_size=4, num_state_slots=1, attention_free=True)
    a = req("a", 100)
    assert kv.can_fit(10_000)
    assert kv.allocate_slots(a, 100) == [] and kv.get_block_ids("a") == [] and kv.get_state_slot("a") == 0
    assert kv.allocate_slots(req("b", 1), 1) is None
    kv.free(a)
    assert kv.mamba_manager.get_num_free_slots() == 1 and kv.block_pool.get_num_free_blocks() == 2
