"""Scheduler: continuous batching under one token budget, chunked prefill and preemption by recompute.

Each step (after vLLM V1's design): running requests first, each getting the tokens it still needs (one for a
decode, the next chunk for a partial prefill), then waiting requests while the token budget, ``max_num_seqs``
and free KV blocks last. When a running request cannot get a block, the lowest-priority running request
(the newest, under FCFS) is preempted: its blocks are freed and it goes back to the front of the waiting
queue, to be recomputed from its prompt and outputs so far.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenmill.engine.messages import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from tokenmill.errors import InvalidRequestError


class Scheduler:
    """Decides what each engine step computes and turns the model's samples into outputs.

    Args:
        config: the engine configuration (``cache_config.num_gpu_blocks`` must be set).
    """

    def __init__(self, config: EngineConfig) -> None:
        sc = config.scheduler_config
        self.max_num_seqs = sc.max_num_seqs
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        self.long_prefill_token_threshold = sc.long_prefill_token_threshold
        self.enable_chunked_prefill = sc.enable_chunked_prefill
        self.policy = sc.policy
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: must be 'fcfs' or 'priority', got {self.policy!r}")
        self.max_model_len = config.model_config.max_model_len
        num_blocks = config.cache_config.num_gpu_blocks
        if not num_blocks:
            raise ValueError("cache_config.num_gpu_blocks is not set; size the KV cache first")
        self.block_size = config.cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, config.cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self._num_preemptions = 0
        self._sent_to_workers: set[str] = set()
        # PP: stages before the last never see sampled tokens, so cached requests carry their input tokens
        self._send_token_ids = config.parallel_config.pipeline_parallel_size > 1
        lora_config = getattr(config, "lora_config", None)
        self.max_loras = lora_config.max_loras if lora_config is not None else 0

    # ------------------------------------------------------------------ admission

    def add_request(self, request: Request) -> None:
        """Queue a request.

        Raises:
            InvalidRequestError: the request id is in use, or the request could never fit in the context
                length or in the whole KV cache (it would otherwise wait or preempt forever).
        """
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", "request_id")
        if request.num_prompt_tokens == 0:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if request.num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {request.num_prompt_tokens} tokens; the context length is {self.max_model_len} "
                "and at least one token must be generated",
                "prompt",
            )
        capacity = self.kv_cache_manager.num_blocks * self.block_size
        if not self.kv_cache_manager.can_fit(request.num_prompt_tokens + 1):
            raise InvalidRequestError(
                f"the prompt has {request.num_prompt_tokens} tokens but the whole KV cache holds {capacity} "
                "tokens (at least one token must be generated); shorten the prompt or give the engine a larger "
                "KV cache (--kv-cache-memory)",
                "prompt",
            )
        longest = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        if not self.kv_cache_manager.can_fit(longest):
            raise InvalidRequestError(
                f"the request needs up to {longest} tokens of KV cache but the whole cache holds {capacity} "
                "tokens; lower max_tokens or give the engine a larger KV cache (--kv-cache-memory)",
                "max_tokens",
            )
        self.requests[request.request_id] = request
        request.record_event(EngineCoreEventType.QUEUED)
        self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            # The queue stays sorted: insert after equal keys (FIFO among equals) instead of re-sorting it.
            at = bisect.bisect_right(self.waiting, _priority_key(request), key=_priority_key)
            self.waiting.insert(at, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish requests as aborted and free their blocks; unknown or finished ids are ignored."""
        aborted = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)
            aborted.append(request)
        return aborted

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        if request.request_id in self._sent_to_workers:
            self._sent_to_workers.discard(request.request_id)
            self.finished_req_ids.add(request.request_id)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens. Never exceeds the token budget, ``max_num_seqs`` or the KV cache."""
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted_any = False

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_tokens_to_schedule(request, budget)
            if num_new == 0:
                i += 1
                continue
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim = self._pick_victim(i)
                self._preempt(victim)
                preempted_any = True
                if victim is request:
                    break
            if new_blocks is None:
                break  # the request preempted itself; nothing after it in `running` can fit either
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            if request.request_id in self._sent_to_workers:
                cached.req_ids.append(request.request_id)
                cached.new_block_ids.append([b.block_id for b in new_blocks])
                cached.num_computed_tokens.append(request.num_computed_tokens)
                if self._send_token_ids:
                    start = request.num_computed_tokens
                    cached.new_token_ids.append(list(request.all_token_ids[start : start + num_new]))
            else:
                new_reqs.append(self._new_request_data(request))
            i += 1

        # LoRA: the running batch never uses more distinct adapters than the workers have slots; a waiting
        # request whose adapter would exceed that is skipped this step (it keeps its place in the queue).
        running_loras = {r.lora_int_id for r in self.running if r.lora_request is not None} if self.max_loras else set()
        skipped: list[Request] = []
        while not preempted_any and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if (self.max_loras and request.lora_request is not None and request.lora_int_id not in running_loras
                    and len(running_loras) >= self.max_loras):
                skipped.append(self.waiting.popleft())
                continue
            # Prompt logprobs need the hidden state of every prompt position, so such a request reads
            # nothing from the prefix cache (its blocks are still cached for others).
            wants_prompt_logprobs = request.sampling_params.prompt_logprobs is not None
            looked_up = request.num_computed_tokens == 0 and not wants_prompt_logprobs
            if looked_up:
                hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            else:
                hits, num_hit_tokens = [], 0
            remaining = request.num_tokens - request.num_computed_tokens - num_hit_tokens
            if not self.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            if self.long_prefill_token_threshold > 0:
                num_new = min(num_new, self.long_prefill_token_threshold)
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, hits, num_hit_tokens)
            if new_blocks is None:
                break
            self.waiting.popleft()
            if looked_up:
                # Counted here, once per admission: a request that waits several steps is looked up each time.
                self.kv_cache_manager.record_prefix_cache_lookup(request.num_tokens, num_hit_tokens)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens += num_hit_tokens
            request.status = RequestStatus.RUNNING
            request.record_event(EngineCoreEventType.SCHEDULED)
            self._add_running(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            new_reqs.append(self._new_request_data(request))
            if request.lora_request is not None:
                running_loras.add(request.lora_int_id)
        self.waiting.extendleft(reversed(skipped))

        for request in self.running:
            n = num_scheduled.get(request.request_id)
            if n is not None:
                request.num_computed_tokens += n
        finished = self.finished_req_ids
        self.finished_req_ids = set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
        )

    def _add_running(self, request: Request) -> None:
        """Append to ``running``; under the ``priority`` policy keep it ordered by (priority, arrival).

        The running loop serves requests in list order and a request short of blocks preempts only requests
        after it, so the ordering guarantees a request is never preempted in favour of a lower-priority one.
        """
        if self.policy == "priority":
            bisect.insort(self.running, request, key=_priority_key)
        else:
            self.running.append(request)

    def _num_tokens_to_schedule(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        if self.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.long_prefill_token_threshold)
        return max(0, min(num_new, budget))

    def _new_request_data(self, request: Request) -> NewRequestData:
        self._sent_to_workers.add(request.request_id)
        return NewRequestData(
            req_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            eos_token_id=None if request.sampling_params.ignore_eos else request.eos_token_id,
            lora_request=request.lora_request,
        )

    def _pick_victim(self, first_unscheduled: int) -> Request:
        # Only requests not yet scheduled this step are candidates, so nothing scheduled is undone.
        candidates = self.running[first_unscheduled:]
        if self.policy == "priority":
            return max(candidates, key=_priority_key)
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.record_event(EngineCoreEventType.PREEMPTED)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        if request.request_id in self._sent_to_workers:
            self._sent_to_workers.discard(request.request_id)
            self.finished_req_ids.add(request.request_id)
        self._enqueue(request, front=True)

    # ------------------------------------------------------------------ results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens, apply stop conditions, free finished requests and build the outputs."""
        outputs: list[EngineCoreOutput] = []
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        for idx, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            sampled = runner_output.sampled_token_ids[idx]
            if not sampled:
                continue  # partial prefill: nothing to emit yet
            # Only the first output carries prompt logprobs (a request resumed after preemption has outputs).
            req_prompt_lps = None
            if prompt_logprobs is not None and not request.output_token_ids:
                req_prompt_lps = prompt_logprobs[idx]
            new_ids: list[int] = []
            for token_id in sampled:
                request.append_output_token_id(token_id)
                new_ids.append(token_id)
                if request.check_stop(self.max_model_len):
                    break
            req_logprobs = logprobs[idx] if logprobs is not None else None
            out = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=new_ids,
                finish_reason=request.status.finish_reason,
                stop_reason=request.stop_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                new_logprobs=req_logprobs[: len(new_ids)] if req_logprobs else None,
                prompt_logprobs=req_prompt_lps,
                events=request.take_events(),
            )
            outputs.append(out)
            if request.is_finished:
                self.running.remove(request)
                self._free_request(request)
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic(), scheduler_stats=self.make_stats())

    def make_stats(self) -> SchedulerStats:
        queries, hits = self.kv_cache_manager.take_prefix_cache_stats()
        preemptions, self._num_preemptions = self._num_preemptions, 0
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=preemptions,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()


def _priority_key(request: Request) -> tuple[int, float]:
    """Sort key of the ``priority`` policy: lower ``priority`` first, then earlier arrival."""
    return (request.priority, request.arrival_time)
