"""ModelRunner: holds the model and its KV cache, turns a SchedulerOutput into one forward pass and samples."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from tokenmill.attention.selector import load_backend_cls, set_attn_backend
from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.distributed import get_pp_size
from tokenmill.forward_context import set_forward_context
from tokenmill.layers.attention import Attention
from tokenmill.layers.pipeline import IntermediateTensors
from tokenmill.layers.pooler import build_pooler
from tokenmill.attention.kv_cache_quant import check_kv_cache_dtype
from tokenmill.attention.paged_cache import allocate_kv_caches, kv_cache_bytes_per_block
from tokenmill.layers.linear_method import attach_linear_method
from tokenmill.layers.mamba import MambaBase, StateMetadata, allocate_state_caches, state_bytes_per_slot
from tokenmill.layers.quantization import quantize_model
from tokenmill.lora.manager import LoRAModelManager
from tokenmill.dtypes import kv_cache_dtype_to_torch, str_to_dtype
from tokenmill.model_loader.loader import get_model
from tokenmill.model_contract import supports_multimodal
from tokenmill.worker.compiled_runner import CompiledRunner
from tokenmill.worker.encoder_runner import EncoderRunner, mm_prefix_ranges
from tokenmill.worker.grammar_bitmask import apply_grammar_bitmask
from tokenmill.worker.graph_runner import GraphRunner
from tokenmill.worker.input_batch import CachedRequestState, build_batch_inputs, build_sampling_metadata
from tokenmill.worker.pooling_collector import PoolingCollector
from tokenmill.worker.logits_processor import LogitsProcessorBatch, apply_logits_processors, build_logits_processors
from tokenmill.worker.request_logits_processors import apply_request_processors
from tokenmill.worker.sampler import Sampler, gather_logprobs

LogprobEntry = tuple[list[int], list[float], int]


class ModelRunner:
    """Runs the model for the scheduled tokens of a step.

    Args:
        config: the engine configuration.
        device: where the model and KV cache live.
        attn_backend_path: ``"module:Class"`` of the attention backend the platform chose.
    """

    def __init__(self, config: EngineConfig, device: torch.device, attn_backend_path: str) -> None:
        self.config = config
        self.device = device
        self.block_size = config.cache_config.block_size
        self.dtype = str_to_dtype(config.model_config.dtype)
        cache_dtype = config.cache_config.cache_dtype
        self.kv_cache_dtype = self.dtype if cache_dtype == "auto" else kv_cache_dtype_to_torch(cache_dtype)
        self.attn_backend = load_backend_cls(attn_backend_path)
        check_kv_cache_dtype(self.attn_backend, cache_dtype)
        set_attn_backend(self.attn_backend)
        self.model: torch.nn.Module | None = None
        self.attn_layers: list[Attention] = []
        self.kv_caches: list[torch.Tensor] = []
        # hybrid models: the state layers, their caches ([num_state_slots, ...] each) and each request's slot
        self.state_layers: list[MambaBase] = []
        self.state_caches: list[torch.Tensor] = []
        self.state_slots: dict[str, int] = {}
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        # req_id -> prompt logprobs accumulated over the chunks of its prefill so far
        self.prompt_logprobs: dict[str, list[LogprobEntry]] = {}
        self.vocab_size = config.model_config.vocab_size
        self.graph_runner: GraphRunner | None = None  # device graphs for decode steps (platform-provided)
        self.compiled_runner: CompiledRunner | None = None  # torch.compile'd forward passes
        self.lora_manager: LoRAModelManager | None = None  # with --enable-lora (tokenmill.lora)
        self.spec_decoder = None  # tokenmill.spec_decode.spec_decoder.SpecDecoder with speculative decoding
        spec_config = getattr(config, "speculative_config", None)
        if spec_config is not None:
            from tokenmill.spec_decode.spec_decoder import SpecDecoder

            self.spec_decoder = SpecDecoder(spec_config, self.block_size, device, self.attn_backend,
                                            config.model_config.max_model_len, self.kv_cache_dtype)
        self.logits_processors = build_logits_processors(config, device)  # plugins' and --logits-processors
        # --logits-processor-pattern: requests may name their own (tokenmill.worker.request_logits_processors)
        self.logits_processor_pattern: str | None = getattr(config, "logits_processor_pattern", None)
        self.process_logits = bool(self.logits_processors) or self.logits_processor_pattern is not None
        self.process_weights = True  # False in the compile worker: it traces, never runs, so nothing is prepacked
        self.pooling_collector: PoolingCollector | None = None  # with the pooling runner (docs/pooling.md)
        self.encoder_runner: EncoderRunner | None = None  # a model that takes images (docs/multimodal.md)
        self.uses_mrope = False  # 3-D rotary positions (Qwen2-VL): the model gets [3, T] positions
        self.mm_prefix_lm = False  # bidirectional attention within an image's tokens (Gemma 3)

    def load_model(self) -> None:
        """Build and load the model, attach quantized copies, then the platform's linear method (which may
        prepare weights; not where :attr:`process_weights` is false), LoRA slots and the draft model."""
        self.model = get_model(self.config.model_config, self.device)
        if self.config.model_config.quantization:
            quantize_model(self.model, self.config.model_config.quantization)
        attach_linear_method(self.model, process=self.process_weights)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.state_layers = [m for m in self.model.modules() if isinstance(m, MambaBase)]
        if self.state_layers and self.spec_decoder is not None:
            raise ValueError("speculative_config: speculative decoding is not supported for models with state "
                             "layers (a rejected draft cannot be taken back out of a state)")
        lc = self.config.lora_config
        if lc is not None:
            self.lora_manager = LoRAModelManager(self.model, lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras)
        if self.spec_decoder is not None:
            self.spec_decoder.load_model(process_weights=self.process_weights)
        if supports_multimodal(self.model):
            self.encoder_runner = EncoderRunner(self.model, self.device)
        self.uses_mrope = bool(getattr(self.model, "uses_mrope", False))
        self.mm_prefix_lm = bool(getattr(self.model, "is_mm_prefix_lm", False))
        if self.mm_prefix_lm and not getattr(self.attn_backend, "supports_mm_prefix", False):
            raise ValueError(f"attention backend {self.attn_backend.name or self.attn_backend.__qualname__} does not "
                             "support bidirectional attention within an image's tokens (supports_mm_prefix), which "
                             f"{type(self.model).__name__} needs; use TORCH_PAGED")
        mc = self.config.model_config
        if mc.runner_type == "pooling":
            self.pooling_collector = PoolingCollector(build_pooler(self.model, mc.pooler_config, mc.convert))

    def model_memory_bytes(self) -> int:
        assert self.model is not None
        seen, total = set(), 0
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if t.is_meta:  # a weight kept only quantized (its buffers count)
                continue
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        if self.spec_decoder is not None:
            total += self.spec_decoder.model_memory_bytes()
        return total

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Peak activation bytes of the largest step: one forward pass over ``max_num_batched_tokens`` tokens
        (as one causal sequence, without the KV cache) plus the logits and sampling probabilities of
        ``max_num_seqs`` rows, measured with the platform's peak-memory statistics beyond what was allocated
        before (the weights). Only called where ``Platform.supports_memory_profiling()``.
        """
        from tokenmill.platforms import get_current_platform

        assert self.model is not None
        platform = get_current_platform()
        sched = self.config.scheduler_config
        num_tokens = sched.max_num_batched_tokens
        num_rows = max(1, min(sched.max_num_seqs, num_tokens))
        platform.synchronize()
        platform.empty_cache()
        before = platform.get_current_memory_bytes()
        platform.reset_peak_memory_stats()
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % max(1, self.config.model_config.max_model_len)
        with set_forward_context(None):
            hidden = self.model(input_ids, positions)
        if getattr(self.model, "has_lm_head", True):  # pooling-only models have none
            logits = self.model.compute_logits(hidden[:num_rows]).float()
            torch.softmax(logits, dim=-1)
            del logits
        platform.synchronize()
        peak = platform.get_peak_memory_bytes()
        del hidden
        platform.empty_cache()
        return max(0, peak - before)

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one block takes across all attention layers of this rank (and the draft model's)."""
        draft = self.spec_decoder.kv_cache_bytes_per_block() if self.spec_decoder is not None else 0
        return (kv_cache_bytes_per_block(self.attn_backend, self.attn_layers, self.block_size, self.kv_cache_dtype)
                + draft)

    def state_bytes_per_slot(self) -> int:
        """Bytes one state slot takes across all state layers (0 without state layers)."""
        return state_bytes_per_slot(self.state_layers, self.dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's cache (zeros, through ``Platform.allocate_kv_cache``) and bind it to the layer;
        then capture or compile the forward passes, and in blocking mode wait for the platform to finish the
        caches (``Platform.finish_kv_cache_allocation``)."""
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(self.attn_backend, self.attn_layers, num_blocks, self.block_size,
                                            self.kv_cache_dtype, self.device)
        if self.spec_decoder is not None:
            self.spec_decoder.initialize_kv_cache(num_blocks)
        if self.state_layers:
            num_slots = self.config.cache_config.num_state_slots
            if num_slots < 1:
                raise ValueError("cache_config.num_state_slots: the model has state layers but no state slots "
                                 "were configured (build the configuration with EngineArgs)")
            self.state_caches = allocate_state_caches(self.state_layers, num_slots, self.dtype, self.device)
        # State layers: the per-step state metadata is not a graph input, so they run eagerly too.
        # PP: the captured / compiled forwards take no intermediate tensors; LoRA: the per-step adapter mapping is
        # not a graph input. Both run eagerly, as do models that take images (their steps may carry embeddings).
        if (get_pp_size() == 1 and self.lora_manager is None and self.encoder_runner is None
                and not self.state_layers):
            self.graph_runner = GraphRunner.create_if_enabled(self)  # captures against the new cache
            if self.graph_runner is None:
                self.compiled_runner = CompiledRunner.create_if_enabled(self)
        if self.config.compile_mode == "blocking":
            from tokenmill.platforms import get_current_platform

            get_current_platform().finish_kv_cache_allocation()

    def shutdown(self) -> None:
        if self.compiled_runner is not None:
            self.compiled_runner.shutdown()

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.prompt_logprobs.pop(req_id, None)
            self.state_slots.pop(req_id, None)
        self.state_slots.update(so.new_state_slots)
        if self.pooling_collector is not None:
            self.pooling_collector.discard(so.finished_req_ids)
            self.pooling_collector.discard(new.req_id for new in so.scheduled_new_reqs)
        if self.spec_decoder is not None:
            self.spec_decoder.remove_requests(so.finished_req_ids)
            self.spec_decoder.remove_requests(new.req_id for new in so.scheduled_new_reqs)
        for new in so.scheduled_new_reqs:
            self.prompt_logprobs.pop(new.req_id, None)
            self.requests[new.req_id] = CachedRequestState.from_new(new)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.block_ids.extend(cached.new_block_ids[i])
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.new_token_ids:
                # PP: stages before the last never sampled this request's latest tokens; the scheduler sends
                # the step's input tokens and a stage appends those it lacks.
                start, tokens = state.num_computed_tokens, cached.new_token_ids[i]
                have = len(state.token_ids) - start
                if have < len(tokens):
                    state.token_ids.extend(tokens[max(have, 0):])

    @torch.inference_mode()
    def execute_model(
        self, so: SchedulerOutput, intermediate_tensors: IntermediateTensors | None = None
    ) -> ModelRunnerOutput | IntermediateTensors:
        """Run one step; returns the sampled token of every request that reached the end of its known tokens.

        With pipeline parallelism a stage other than the first gets the previous stage's activations as
        ``intermediate_tensors``, and a stage other than the last returns its own activations instead of
        sampling.
        """
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        assert self.model is not None
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        counts = [so.num_scheduled_tokens[r] for r in req_ids]
        spec = so.scheduled_spec_decode_tokens
        drafts = [spec.get(r, []) for r in req_ids] if spec else None
        batch = build_batch_inputs(states, counts, self.block_size, self.device, spec_token_ids=drafts)
        positions = batch.positions
        if self.uses_mrope:
            positions = self._mrope_positions(states, counts)
        inputs_embeds = None
        if self.encoder_runner is not None:
            self.encoder_runner.execute(so, self.requests)
            if self.mm_prefix_lm:
                batch.attn_metadata.mm_prefix_ranges = mm_prefix_ranges(states, counts)
            inputs_embeds = self.encoder_runner.input_embeddings(batch.input_ids, states, counts,
                                                                 batch.attn_metadata.query_start_loc_cpu)
        if self.lora_manager is not None:
            # per token of the batch (drafts included: the target verifies them with the request's adapter)
            self.lora_manager.prepare_step([s.lora_request for s in states], counts, self.device)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            hidden = self.graph_runner.run(batch)  # decode-only step: replay the captured graph (padded)
        elif self.compiled_runner is not None and self.compiled_runner.can_run(batch):
            hidden = self.compiled_runner.run(batch)
        elif inputs_embeds is not None:
            with set_forward_context(batch.attn_metadata):
                hidden = self.model(batch.input_ids, positions, inputs_embeds=inputs_embeds)
        elif get_pp_size() > 1:
            with set_forward_context(batch.attn_metadata):
                hidden = self.model(batch.input_ids, batch.positions, intermediate_tensors)
            if isinstance(hidden, IntermediateTensors):  # PP: not the last stage
                for state, n in zip(states, counts):
                    state.num_computed_tokens += n
                return hidden
        else:
            eager = self.compiled_runner.eager_step() if self.compiled_runner is not None else nullcontext()
            state_md = None
            if self.state_layers:
                state_md = StateMetadata.build(batch.attn_metadata.query_start_loc_cpu,
                                               [self.state_slots[r] for r in req_ids],
                                               [s.num_computed_tokens for s in states], self.device)
            with eager, set_forward_context(batch.attn_metadata, state_metadata=state_md):
                hidden = self.model(batch.input_ids, positions)
        self._accumulate_prompt_logprobs(states, counts, batch.attn_metadata.query_start_loc_cpu, hidden)
        sample_rows = [i for i, m in enumerate(batch.sample_mask) if m]
        pooler_output = None
        if self.pooling_collector is not None:
            pooler_output = self.pooling_collector.collect(states, counts, batch.attn_metadata.query_start_loc_cpu,
                                                           hidden)
            if pooler_output is not None:  # pooling requests are never sampled
                sample_rows = [i for i in sample_rows if states[i].pooling_params is None]
        prompt_logprobs: list[list[LogprobEntry] | None] | None = None
        for i in sample_rows:
            done = self.prompt_logprobs.pop(req_ids[i], None)
            if done is not None:
                if prompt_logprobs is None:
                    prompt_logprobs = [None] * len(req_ids)
                prompt_logprobs[i] = done
        sampled_ids: list[list[int]] = [[] for _ in req_ids]
        logprobs: list | None = None
        num_rejected = [0] * len(req_ids)
        if sample_rows and drafts is not None:
            assert self.spec_decoder is not None
            constrain = None
            if so.grammar_bitmask is not None or self.process_logits:
                def constrain(logits: torch.Tensor, batch_rows: list[int],
                              row_states: list[CachedRequestState]) -> torch.Tensor:
                    if self.process_logits:
                        logits = self._process_logits(logits, row_states)
                    if so.grammar_bitmask is not None:
                        logits = apply_grammar_bitmask(logits, [req_ids[i] for i in batch_rows],
                                                       so.grammar_bitmask, so.structured_output_request_ids)
                    return logits
            verified = self.spec_decoder.verify(
                self.model, hidden, batch.attn_metadata.query_start_loc_cpu, states, sample_rows,
                [drafts[i] for i in sample_rows], self.vocab_size, constrain,
            )
            if verified.logprobs is not None:
                logprobs = [None] * len(req_ids)
            for j, i in enumerate(sample_rows):
                sampled_ids[i] = verified.token_ids[j]
                num_rejected[i] = len(drafts[i]) - verified.num_accepted[j]
                states[i].token_ids.extend(verified.token_ids[j])
                if verified.logprobs is not None:
                    logprobs[i] = verified.logprobs[j]
        elif sample_rows:
            rows = torch.tensor(sample_rows, device=self.device)
            logits = self.model.compute_logits(hidden[batch.logits_indices[rows]])
            if self.process_logits:
                logits = self._process_logits(logits, [states[i] for i in sample_rows])
            if so.grammar_bitmask is not None:
                logits = apply_grammar_bitmask(
                    logits, [req_ids[i] for i in sample_rows], so.grammar_bitmask, so.structured_output_request_ids
                )
            sample_states = [states[i] for i in sample_rows]
            md = build_sampling_metadata(sample_states, self.vocab_size, self.device)
            out = self.sampler(logits, md)
            tokens = out.sampled_token_ids.tolist()
            if out.logprobs is not None:
                logprobs = [None] * len(req_ids)
                ids, lps, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_ranks.tolist()
                for j, i in enumerate(sample_rows):
                    want = states[i].sampling_params.logprobs
                    if want is not None:
                        logprobs[i] = [(ids[j][: want + 1], lps[j][: want + 1], ranks[j])]
            for j, i in enumerate(sample_rows):
                sampled_ids[i] = [tokens[j]]
                states[i].token_ids.append(tokens[j])
        for state, n, rejected in zip(states, counts, num_rejected):
            state.num_computed_tokens += n - rejected  # rejected drafts' KV is overwritten later
        spec_token_ids = None
        if self.spec_decoder is not None and sample_rows:
            proposals = self.spec_decoder.propose([states[i] for i in sample_rows])
            spec_token_ids = [[] for _ in req_ids]
            for j, i in enumerate(sample_rows):
                spec_token_ids[i] = proposals[j]
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled_ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            spec_token_ids=spec_token_ids, pooler_output=pooler_output,
        )

    def _mrope_positions(self, states: list[CachedRequestState], counts: list[int]) -> torch.Tensor:
        """``[3, T]`` M-RoPE positions of the step's tokens: the prompt's from the model's
        ``get_mrope_input_positions`` (once per request), later tokens ``index + delta`` on all three axes."""
        assert self.model is not None
        pieces: list[torch.Tensor] = []
        for state, n in zip(states, counts):
            if state.mrope_positions is None:
                state.mrope_positions, state.mrope_delta = self.model.get_mrope_input_positions(  # type: ignore[operator]
                    state.token_ids[: state.num_prompt_tokens], state.mm_features or [])
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            prompt_len = state.mrope_positions.shape[1]
            if start < prompt_len:
                pieces.append(state.mrope_positions[:, start : min(end, prompt_len)])
            if end > prompt_len:
                pieces.append((torch.arange(max(start, prompt_len), end) + state.mrope_delta).expand(3, -1))
        return torch.cat(pieces, dim=1).to(self.device)

    def _process_logits(self, logits: torch.Tensor, states: list[CachedRequestState]) -> torch.Tensor:
        batch = LogitsProcessorBatch(
            req_ids=[s.req_id for s in states],
            sampling_params=[s.sampling_params for s in states],
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in states],
            output_token_ids=[s.token_ids[s.num_prompt_tokens :] for s in states],
        )
        all_greedy = all(s.sampling_params.is_greedy for s in states)
        logits = apply_logits_processors(self.logits_processors, logits, batch, all_greedy)
        if self.logits_processor_pattern is not None:
            logits = apply_request_processors(logits, states, self.logits_processor_pattern)
        return logits

    def _accumulate_prompt_logprobs(
        self,
        states: list[CachedRequestState],
        counts: list[int],
        query_start_loc: list[int],
        hidden: torch.Tensor,
    ) -> None:
        """Logprobs of the prompt tokens this step's chunk predicts, appended to ``self.prompt_logprobs``.

        The hidden state at prompt position ``p`` predicts prompt token ``p + 1``, so a chunk covering positions
        ``[a, b)`` yields entries for tokens ``a + 1 .. min(b, P - 1)``. Only requests that asked for
        ``prompt_logprobs`` and have no outputs yet (a request resumed after preemption already sent its
        prompt logprobs) take part. All rows of the step go through one ``compute_logits`` call.

        Args:
            states: the step's requests (``num_computed_tokens`` not yet advanced).
            counts: tokens scheduled per request.
            query_start_loc: ``[B + 1]`` offsets of each request's tokens in the flattened batch.
            hidden: ``[T, hidden]`` the model's output for the flattened batch.
        """
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[str, int, int, int]] = []  # req_id, first row, row count, k
        for i, (state, n) in enumerate(zip(states, counts)):
            k = state.sampling_params.prompt_logprobs
            if k is None or state.num_output_tokens > 0:
                continue
            self.prompt_logprobs.setdefault(state.req_id, [])
            start = state.num_computed_tokens
            end = min(start + n, state.num_prompt_tokens - 1)
            if end <= start:
                continue
            spans.append((state.req_id, len(rows), end - start, k))
            rows.extend(range(query_start_loc[i], query_start_loc[i] + end - start))
            targets.extend(state.token_ids[start + 1 : end + 1])
        if not rows:
            return
        assert self.model is not None
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float()
        max_k = max(k for *_, k in spans)
        ids, lps, ranks = gather_logprobs(
            torch.log_softmax(logits, dim=-1), torch.tensor(targets, dtype=torch.int64, device=self.device), max_k
        )
        ids_l, lps_l, ranks_l = ids.tolist(), lps.tolist(), ranks.tolist()
        for req_id, first, num, k in spans:
            acc = self.prompt_logprobs[req_id]
            for r in range(first, first + num):
                acc.append((ids_l[r][: k + 1], lps_l[r][: k + 1], ranks_l[r]))
