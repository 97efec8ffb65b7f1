"""Unit tests without a model: the batched LoRA op against a per-token reference, the token -> slot mapping,
the scheduler's adapter limit, and the adapter's place in prefix-cache block hashes."""

from __future__ import annotations

import torch

from tests.core.test_scheduler import check_invariants, fake_run, make_request
from tokenmill.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.scheduler import Scheduler
from tokenmill.lora import LoRARequest
from tokenmill.lora.ops import LoRABatchMapping, TorchLoRAMethod, get_lora_method


def test_mapping_groups_lora_tokens_by_slot_and_skips_base_tokens():
    m = LoRABatchMapping.build([1, -1, 0, 1], [2, 3, 1, 2], num_slots=3, device=torch.device("cpu"))
    assert m.token_slots.tolist() == [1, 1, -1, -1, -1, 0, 1, 1]
    assert m.order.tolist() == [5, 0, 1, 6, 7]  # slot 0 first, batch order within a slot
    assert m.counts == [1, 4, 0]
    none = LoRABatchMapping.build([-1, -1], [3, 1], num_slots=2, device=torch.device("cpu"))
    assert none.num_lora_tokens == 0 and none.counts == [0, 0]


def test_torch_method_equals_per_token_reference():
    gen = torch.Generator().manual_seed(0)
    slots, rank, d_in, d_out = 3, 6, 16, 12
    a = torch.randn(slots, rank, d_in, generator=gen)
    b = torch.randn(slots, d_out, rank, generator=gen)
    request_slots, counts = [2, -1, 0, 2, 1, -1], [3, 2, 1, 4, 2, 1]
    mapping = LoRABatchMapping.build(request_slots, counts, slots, torch.device("cpu"))
    x = torch.randn(sum(counts), d_in, generator=gen)
    y0 = torch.randn(sum(counts), d_out, generator=gen)
    y = y0.clone()
    TorchLoRAMethod().add_lora(y, x, a, b, mapping)
    ref = y0.clone()
    for t, s in enumerate(mapping.token_slots.tolist()):
        if s >= 0:
            ref[t] += b[s] @ (a[s] @ x[t])
    torch.testing.assert_close(y, ref)
    base_rows = mapping.token_slots < 0
    assert torch.equal(y[base_rows], y0[base_rows])  # base-model tokens are untouched, not just close


def test_platform_default_is_the_torch_method():
    assert isinstance(get_lora_method(), TorchLoRAMethod)


def _lora_scheduler(max_loras: int, budget: int = 64) -> Scheduler:
    mc = ModelConfig(model="fake", tokenizer="fake", hf_config=None, max_model_len=256)
    return Scheduler(EngineConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=4, num_gpu_blocks=64),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
        lora_config=LoRAConfig(max_loras=max_loras, max_lora_rank=8, max_cpu_loras=max_loras),
    ))


def _with_lora(request, lora_id: int | None):
    request.lora_request = None if lora_id is None else LoRARequest(f"a{lora_id}", lora_id, "/nowhere")
    return request


def test_scheduler_never_runs_more_adapters_than_slots_and_keeps_queue_order():
    sched = _lora_scheduler(max_loras=2)
    reqs = [_with_lora(make_request([1, 2, 3], max_tokens=3, rid=f"q{i}"), lid)
            for i, lid in enumerate([1, 2, 3, None, 1, 3])]
    for r in reqs:
        sched.add_request(r)
    seen_admissions: list[str] = []
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        seen_admissions += [n.req_id for n in so.scheduled_new_reqs]
        step_loras = {sched.requests[r].lora_int_id for r in so.num_scheduled_tokens if sched.requests[r].lora_request}
        running_loras = {r.lora_int_id for r in sched.running if r.lora_request is not None}
        assert len(step_loras) <= 2 and len(running_loras) <= 2
        sched.update_from_output(so, fake_run(sched, so))
        check_invariants(sched)
    assert not sched.has_unfinished_requests()
    # q2 (adapter 3) waits for a slot; the base request and q4 (adapter 1, already running) pass it meanwhile
    assert seen_admissions[:4] == ["q0", "q1", "q3", "q4"]
    assert set(seen_admissions) == {f"q{i}" for i in range(6)}
    assert seen_admissions.index("q2") < seen_admissions.index("q5")  # FCFS among the skipped ones


def test_block_hashes_separate_adapters_and_base():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10, 22))
    hashes = []
    for lid in (None, 1, 2, 1):
        r = _with_lora(make_request(prompt), lid)
        kv.get_computed_blocks(r)
        hashes.append(r.block_hashes)
    assert len(hashes[0]) == 3
    assert hashes[0] != hashes[1] and hashes[1] != hashes[2] and hashes[0] != hashes[2]
    assert hashes[1] == hashes[3]
    assert not set(hashes[0]) & set(hashes[1]) and not set(hashes[1]) & set(hashes[2])


def test_lora_modules_flag_forms():
    import pytest

    from tokenmill.entrypoints.openai.serving_models import LoRAModulePath, parse_lora_modules

    assert parse_lora_modules(["sql=/a/b", '{"name": "chat", "path": "/c", "base_model_name": "m"}']) == [
        LoRAModulePath("sql", "/a/b"), LoRAModulePath("chat", "/c", "m")]
    assert parse_lora_modules(None) == []
    for bad in ("noequals", "=/p", "name=", '{"name": "x"}'):
        with pytest.raises(ValueError, match="lora_modules"):
            LoRAModulePath.parse(bad)
