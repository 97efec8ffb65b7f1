"""Scheduler: continuous batching under one token budget, chunked prefill and preemption by recompute.

Each step (after vLLM V1's design): running requests first, each getting the tokens it still needs (one for a
decode, the next chunk for a partial prefill), then waiting requests while the token budget, ``max_num_seqs``
and free KV blocks last. When a running request cannot get a block, the lowest-priority running request
(the newest, under FCFS) is preempted: its blocks are freed and it goes back to the front of the waiting
queue, to be recomputed from its prompt and outputs so far.

Structured outputs (vLLM V1's flow): a constrained request waits in ``WAITING_FOR_GRAMMAR``, passed over while
its grammar compiles on the manager's threads; each step the scheduler sends the token bitmask of every
scheduled constrained request that samples (not those in the middle of a prefill), and
:meth:`Scheduler.update_from_output` advances each matcher with the sampled token. The request stops when the
grammar is terminated. Preemption by recompute keeps every output token, so a preempted request's matcher
state stays valid as it is. A reasoning model's request (``SamplingParams.reasoning``) is not masked, nor its
matcher advanced, until its output contains the end-of-thinking marker; its thinking budget forces the marker
through the same bitmask rows (:class:`tokenmill.core.reasoning_state.ReasoningState`).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable

import numpy as np

from tokenmill.config import EngineConfig
from tokenmill.core.encoder_cache_manager import EncoderCacheManager
from tokenmill.core.kv_cache_coordinator import create_kv_cache_manager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenmill.engine.messages import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    PooledData,
    SchedulerStats,
)
from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.inputs import PlaceholderRange
from tokenmill.spec_decode.metrics import SpecDecodingStats
from tokenmill.structured_output.manager import StructuredOutputManager


# Encoder-cache rows (and per-step encoder budget) unless MultiModalConfig.encoder_cache_size says otherwise: a
# few large images' worth (a 336-px CLIP image is 576 rows; a Qwen2.5-VL image up to a few thousand).
DEFAULT_ENCODER_CACHE_ROWS = 8192


class Scheduler:
    """Decides what each engine step computes and turns the model's samples into outputs.

    Args:
        config: the engine configuration (``cache_config.num_gpu_blocks`` must be set).
        structured_output_manager: compiles constraints and builds bitmasks (default: a new one for
            ``config``; it loads nothing until a constrained request arrives).
    """

    def __init__(self, config: EngineConfig,
                 structured_output_manager: StructuredOutputManager | None = None) -> None:
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
        # KVCacheManager, or with state layers the hybrid coordinator that also hands out state slots
        self.kv_cache_manager = create_kv_cache_manager(num_blocks, config.cache_config)
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
        spec = getattr(config, "speculative_config", None)
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.num_lookahead_tokens = spec.num_lookahead_tokens if spec is not None else 0
        self.spec_decoding_stats = SpecDecodingStats.new(self.num_spec_tokens)
        self.structured_output_manager = structured_output_manager or StructuredOutputManager(config)
        # Outputs of requests failed outside a model step (a grammar that did not compile), sent with the next.
        self._pending_outputs: list[EngineCoreOutput] = []
        # Image encoder outputs (docs/multimodal.md): the per-step budget of encoded rows is the cache's size.
        mm_config = getattr(config, "multimodal_config", None)
        encoder_rows = getattr(mm_config, "encoder_cache_size", 0) or max(DEFAULT_ENCODER_CACHE_ROWS,
                                                                          self.max_num_batched_tokens)
        self.encoder_cache_manager = EncoderCacheManager(encoder_rows)
        # Multimodal prefix-LM (Gemma 3): an image's tokens attend to each other both ways, so a prefill chunk
        # never ends inside a run of an image's embedding tokens (vLLM's disable_chunked_mm_input).
        self.mm_prefix_lm = bool(getattr(config.model_config, "is_mm_prefix_lm", False))
        self.max_chunk_tokens = self.max_num_batched_tokens if self.long_prefill_token_threshold <= 0 \
            else min(self.max_num_batched_tokens, self.long_prefill_token_threshold)

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
        if request.pooling_params is not None:
            self._check_pooling_request(request)
        elif request.num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {request.num_prompt_tokens} tokens; the context length is {self.max_model_len} "
                "and at least one token must be generated",
                "prompt",
            )
        capacity = self.kv_cache_manager.num_blocks * self.block_size
        if request.pooling_params is None and not self.kv_cache_manager.can_fit(request.num_prompt_tokens + 1):
            raise InvalidRequestError(
                f"the prompt has {request.num_prompt_tokens} tokens but the whole KV cache holds {capacity} "
                "tokens (at least one token must be generated); shorten the prompt or give the engine a larger "
                "KV cache (--kv-cache-memory)",
                "prompt",
            )
        for feature in request.mm_features:
            if feature.placeholder.num_embeds > self.encoder_cache_manager.cache_size:
                raise InvalidRequestError(
                    f"an image of the prompt takes {feature.placeholder.num_embeds} embedding rows, more than the "
                    f"encoder cache holds ({self.encoder_cache_manager.cache_size} rows)", "prompt")
            longest_run = max((b - a for a, b in feature.placeholder.embed_runs()), default=0) \
                if self.mm_prefix_lm else 0
            if longest_run > self.max_chunk_tokens:
                raise InvalidRequestError(
                    f"an image of the prompt has a run of {longest_run} tokens, which must be computed in one step "
                    f"(bidirectional attention among them), but a step takes at most {self.max_chunk_tokens} "
                    "prompt tokens (--max-num-batched-tokens, --long-prefill-token-threshold)", "prompt")
        longest = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        if request.pooling_params is None and not self.kv_cache_manager.can_fit(longest):
            raise InvalidRequestError(
                f"the request needs up to {longest} tokens of KV cache but the whole cache holds {capacity} "
                "tokens; lower max_tokens or give the engine a larger KV cache (--kv-cache-memory)",
                "max_tokens",
            )
        self.requests[request.request_id] = request
        request.record_event(EngineCoreEventType.QUEUED)
        self._enqueue(request)
        if request.use_structured_output:
            self.structured_output_manager.grammar_init(request)

    def _check_pooling_request(self, request: Request) -> None:
        """A pooling request needs room for its prompt only (nothing is generated)."""
        if request.num_prompt_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {request.num_prompt_tokens} tokens; the context length is {self.max_model_len}",
                "prompt",
            )
        if not self.kv_cache_manager.can_fit(request.num_prompt_tokens):
            capacity = self.kv_cache_manager.num_blocks * self.block_size
            raise InvalidRequestError(
                f"the prompt has {request.num_prompt_tokens} tokens but the whole KV cache holds {capacity} "
                "tokens; shorten the prompt or give the engine a larger KV cache (--kv-cache-memory)",
                "prompt",
            )

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
        if request.mm_features:
            self.encoder_cache_manager.free(request)
        if request.use_structured_output:
            self.structured_output_manager.free(request)
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
        spec_tokens: dict[str, list[int]] = {}
        encoder_budget = self.encoder_cache_manager.cache_size
        encoder_inputs: dict[str, list[int]] = {}

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_tokens_to_schedule(request, budget)
            to_encode: list[int] = []
            if request.mm_features:
                to_encode, num_new, encoder_budget = self._schedule_encoder_inputs(
                    request, request.num_computed_tokens, num_new, encoder_budget)
            if num_new == 0:
                i += 1
                continue
            num_drafts = num_new - (request.num_tokens - request.num_computed_tokens)
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new, num_lookahead_tokens=self._lookahead(request, num_new)
                )
                if new_blocks is not None:
                    break
                victim = self._pick_victim(i)
                if victim is request:
                    self._cancel_encoder_inputs(request, to_encode)
                self._preempt(victim)
                preempted_any = True
                if victim is request:
                    break
            if new_blocks is None:
                break  # the request preempted itself; nothing after it in `running` can fit either
            if to_encode:
                encoder_inputs[request.request_id] = to_encode
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            if num_drafts > 0:
                spec_tokens[request.request_id] = request.spec_token_ids[:num_drafts]
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

        # Skipped requests keep their place in the queue: one waiting for its grammar, and (LoRA) one whose
        # adapter would make the running batch use more distinct adapters than the workers have slots.
        running_loras = {r.lora_int_id for r in self.running if r.lora_request is not None} if self.max_loras else set()
        skipped: list[Request] = []
        while not preempted_any and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR and not self._grammar_ready(request):
                if not request.is_finished:  # a failed grammar has already left the queue
                    skipped.append(self.waiting.popleft())
                continue
            if (self.max_loras and request.lora_request is not None and request.lora_int_id not in running_loras
                    and len(running_loras) >= self.max_loras):
                skipped.append(self.waiting.popleft())
                continue
            # Prompt logprobs and pooling need the hidden state of every prompt position, so such a request
            # reads nothing from the prefix cache (its blocks are still cached for others).
            needs_all_positions = (request.sampling_params.prompt_logprobs is not None
                                   or request.pooling_params is not None)
            looked_up = request.num_computed_tokens == 0 and not needs_all_positions
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
            to_encode = []
            if request.mm_features:
                to_encode, num_new, encoder_budget = self._schedule_encoder_inputs(
                    request, request.num_computed_tokens + num_hit_tokens, num_new, encoder_budget)
                if num_new == 0:
                    break  # its next image does not fit this step's encoder budget or cache
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new, hits, num_hit_tokens,
                num_lookahead_tokens=self._lookahead(request, num_hit_tokens + num_new),
            )
            if new_blocks is None:
                self._cancel_encoder_inputs(request, to_encode)
                break
            self.waiting.popleft()
            if to_encode:
                encoder_inputs[request.request_id] = to_encode
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

        if skipped:
            self.waiting.extendleft(reversed(skipped))

        for request in self.running:
            n = num_scheduled.get(request.request_id)
            if n is not None:
                request.num_computed_tokens += n
                if request.mm_features:
                    self._release_computed_images(request)
        so_request_ids, bitmask = self._grammar_bitmask(num_scheduled)
        finished = self.finished_req_ids
        self.finished_req_ids = set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
            structured_output_request_ids=so_request_ids,
            grammar_bitmask=bitmask,
            scheduled_spec_decode_tokens=spec_tokens,
            scheduled_encoder_inputs=encoder_inputs,
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            new_state_slots=self._state_slots(new_reqs),
        )

    def _schedule_encoder_inputs(self, request: Request, num_computed: int, num_new: int, budget: int
                                 ) -> tuple[list[int], int, int]:
        """The images whose placeholders the chunk ``[num_computed, num_computed + num_new)`` reaches and that
        must be encoded this step (not cached), within the encoder ``budget``; the chunk stops before the first
        image that does not fit. Their encoder-cache room is allocated here (undo with
        :meth:`_cancel_encoder_inputs` if the chunk is not scheduled), and cached images the chunk reaches get
        the request's reference. Returns ``(image indices to encode, num_new, budget left)``.

        For a multimodal prefix-LM the chunk also stops before the first run of an image's embedding tokens
        (``PlaceholderRange.embed_runs``) it would end inside: the run's tokens attend to its later tokens, which
        must be in the same step (vLLM's ``disable_chunked_mm_input``, per run). A chunk that starts inside a run
        (a prefix-cache hit ending there: the cached part saw the whole run when it was computed) must reach the
        run's end, else ``num_new`` is 0 and the request waits for a step with room."""
        manager = self.encoder_cache_manager
        end = num_computed + num_new
        to_encode: list[int] = []
        for index, feature in enumerate(request.mm_features):
            start, rows = feature.placeholder.offset, feature.placeholder.num_embeds
            if start >= end:
                break
            if feature.placeholder.end <= num_computed:
                continue  # its embeddings are in the KV cache already
            if self.mm_prefix_lm and end < feature.placeholder.end:
                end = _end_outside_runs(feature.placeholder, num_computed, end)
                num_new = end - num_computed
                if start >= end or num_new == 0:
                    break  # the chunk no longer reaches this image (or waits for room for the rest of a run)
            if manager.check_and_update_cache(request, index):
                continue  # cached, or encoded this step (an earlier image of the prompt, or another request)
            if not manager.can_allocate(rows, budget):
                num_new = max(0, start - num_computed)
                break
            manager.allocate(request, index)
            to_encode.append(index)
            budget -= rows
        return to_encode, num_new, budget

    def _cancel_encoder_inputs(self, request: Request, to_encode: list[int]) -> None:
        for index in to_encode:
            self.encoder_cache_manager.cancel(request, index)

    def _release_computed_images(self, request: Request) -> None:
        """Drop the request's reference to every image whose placeholder is now wholly computed."""
        for index, feature in enumerate(request.mm_features):
            if feature.placeholder.end <= request.num_computed_tokens:
                self.encoder_cache_manager.free_encoder_input(request, index)

    def _state_slots(self, new_reqs: list[NewRequestData]) -> dict[str, int]:
        """The state slot of each new request (hybrid models only)."""
        slots = {}
        for new in new_reqs:
            slot = self.kv_cache_manager.get_state_slot(new.req_id)
            if slot is not None:
                slots[new.req_id] = slot
        return slots

    def _lookahead(self, request: Request, num_new: int) -> int:
        """KV slots a draft model writes past this step's tokens, capped where the request must end anyway
        (its longest possible sequence was checked to fit the cache at admission)."""
        if not self.num_lookahead_tokens:
            return 0
        longest = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        return max(0, min(self.num_lookahead_tokens, longest - request.num_computed_tokens - num_new))

    def _grammar_ready(self, request: Request) -> bool:
        """For a ``WAITING_FOR_GRAMMAR`` request: True (status now WAITING) once its grammar compiled; False
        while it compiles, or when compilation failed (the request is then finished with the error)."""
        so_request = request.structured_output_request
        assert so_request is not None
        if so_request.check_ready():
            request.status = RequestStatus.WAITING
            return True
        if so_request.error is not None:
            self._fail_request(request, f"structured_outputs: the grammar did not compile: {so_request.error}")
        return False

    def _fail_request(self, request: Request, message: str) -> None:
        """Finish a request that is not running with an error; its output goes out with the next step's."""
        if request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ERROR
        request.error = message
        self._free_request(request)
        self._pending_outputs.append(EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=message,
            events=request.take_events(),
        ))

    def _grammar_bitmask(self, num_scheduled: dict[str, int]) -> tuple[list[str], np.ndarray | None]:
        """The constrained requests that sample this step (their computed tokens reach their known tokens),
        in batch order, and their bitmask rows; a reasoning request with a thinking budget counts as constrained
        (its row forces the end marker once the budget is spent)."""
        ids: list[str] = []
        requests: list[Request] = []
        for req_id in num_scheduled:
            request = self.requests[req_id]
            so_request = request.structured_output_request
            constrained = so_request is not None and so_request.grammar is not None
            forcing = request.reasoning is not None and request.reasoning.constrains_sampling
            if (constrained or forcing) and request.num_computed_tokens >= request.num_tokens:
                ids.append(req_id)
                requests.append(request)
        if not requests:
            return ids, None
        return ids, self.structured_output_manager.grammar_bitmask(requests)

    def requests_waiting_for_grammar(self) -> list[Request]:
        return [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_GRAMMAR]

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
        # known tokens not yet computed, plus the draft tokens to verify (speculative decoding)
        num_new = request.num_tokens + len(request.spec_token_ids) - request.num_computed_tokens
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
            pooling_params=request.pooling_params,
            mm_features=request.mm_features or None,
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
        if request.mm_features:
            self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.record_event(EngineCoreEventType.PREEMPTED)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
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
        outputs, self._pending_outputs = self._pending_outputs, []
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        for idx, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            sampled = runner_output.sampled_token_ids[idx]
            request.spec_token_ids = []
            if not sampled:
                pooled = runner_output.pooler_output
                if pooled is not None and pooled[idx] is not None:
                    outputs.append(self._finish_pooling(request, pooled[idx]))
                continue  # partial prefill: nothing to emit yet
            num_drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            if num_drafts:
                # rejected drafts: their KV slots are rolled back (overwritten by later tokens); prefix-cache
                # hashes only ever cover request.all_token_ids, which holds verified tokens only
                num_accepted = len(sampled) - 1
                request.num_computed_tokens -= num_drafts - num_accepted
                self.spec_decoding_stats.observe_draft(num_drafts, num_accepted)
            # Only the first output carries prompt logprobs (a request resumed after preemption has outputs).
            req_prompt_lps = None
            if prompt_logprobs is not None and not request.output_token_ids:
                req_prompt_lps = prompt_logprobs[idx]
            new_ids: list[int] = []
            so_request = request.structured_output_request
            for token_id in sampled:
                request.append_output_token_id(token_id)
                new_ids.append(token_id)
                thinking = request.in_reasoning  # the thinking, end marker included, is not the grammar's
                if thinking:
                    request.reasoning.observe(request.output_token_ids)  # type: ignore[union-attr]
                if so_request is not None and not thinking and not self._advance_grammar(request, token_id):
                    break
                if request.check_stop(self.max_model_len):
                    break
                if so_request is not None and so_request.grammar is not None and so_request.grammar.is_terminated():
                    request.status = RequestStatus.FINISHED_STOPPED
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
                error=request.error,
            )
            outputs.append(out)
            if request.is_finished:
                self.running.remove(request)
                self._free_request(request)
            elif runner_output.spec_token_ids is not None and not self._thinking_under_control(request):
                room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens)
                request.spec_token_ids = runner_output.spec_token_ids[idx][: max(0, room - 1)]
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic(), scheduler_stats=self.make_stats())

    def _finish_pooling(self, request: Request, pooled: PooledData) -> EngineCoreOutput:
        """A pooling request whose last prompt chunk ran: finished with its pooled output, blocks freed."""
        request.status = RequestStatus.FINISHED_STOPPED
        out = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=FinishReason.STOP,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            events=request.take_events(),
            pooling_output=pooled,
        )
        self.running.remove(request)
        self._free_request(request)
        return out

    @staticmethod
    def _thinking_under_control(request: Request) -> bool:
        """A request still thinking whose grammar or budget starts at the end marker: it gets no draft tokens
        (drafts verified past the marker would have been sampled without the grammar's mask)."""
        return request.in_reasoning and (request.use_structured_output or request.reasoning.budget is not None)  # type: ignore[union-attr]

    def _advance_grammar(self, request: Request, token_id: int) -> bool:
        """Feed a sampled token to the request's matcher; a token the grammar refuses fails the request."""
        so_request = request.structured_output_request
        assert so_request is not None and so_request.grammar is not None
        if so_request.grammar.accept_tokens(request.request_id, [token_id]):
            return True
        request.status = RequestStatus.FINISHED_ERROR
        request.error = (
            f"structured_outputs: token {token_id} sampled at output position {request.num_output_tokens - 1} "
            "is not allowed by the grammar (other constraints of the request, e.g. min_tokens, "
            "allowed_token_ids or bad_words, left no token the grammar allows)"
        )
        return False

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
            spec_decoding_stats=self.spec_decoding_stats.take() if self.num_spec_tokens else None,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()


def _priority_key(request: Request) -> tuple[int, float]:
    """Sort key of the ``priority`` policy: lower ``priority`` first, then earlier arrival."""
    return (request.priority, request.arrival_time)


def _end_outside_runs(placeholder: PlaceholderRange, num_computed: int, end: int) -> int:
    """``end`` moved back to the start of the run of embedding positions it falls inside (or to
    ``num_computed`` when that run began before the chunk), so the chunk ``[num_computed, end)`` ends inside no
    run of ``placeholder``."""
    for a, b in placeholder.embed_runs():
        if a < end < b:
            return max(a, num_computed)
    return end
