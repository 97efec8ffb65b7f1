"""DraftModelProposer: a small model with the target's vocabulary proposes K tokens per request and step.

The draft runs in the worker next to the target. Its KV cache has the same number of blocks and the same
block size as the target's and is addressed through the *target's* block tables (as vLLM does for its draft
models), so the scheduler allocates one set of blocks for both and one block costs the bytes of both models'
layers. Each step, after the target verified the previous drafts:

1. catch-up: one forward pass over the tokens whose draft KV is missing (a new request's whole sequence, or
   the tokens accepted since the last proposal that the draft did not feed itself, and the new token);
2. K - 1 single-token passes feeding each draft back.

Draft KV written for drafts that the target then rejects is simply overwritten by the next catch-up (the
positions whose draft KV is valid are tracked per request). The draft writes up to K positions past the
target's scheduled tokens; the scheduler reserves them (``SpeculativeConfig.num_lookahead_tokens``).

Greedy requests get greedy drafts (a point mass, so verification is an equality test); random requests draw
each draft from ``softmax(draft_logits / temperature)`` and that distribution goes to the rejection sampler.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmill.config import ModelConfig
from tokenmill.forward_context import set_forward_context
from tokenmill.attention.paged_cache import allocate_kv_caches, kv_cache_bytes_per_block
from tokenmill.layers.attention import Attention
from tokenmill.layers.linear_method import attach_linear_method
from tokenmill.dtypes import str_to_dtype
from tokenmill.model_loader.loader import get_model
from tokenmill.sampling_params import SAMPLING_EPS
from tokenmill.worker.input_batch import CachedRequestState, build_batch_inputs
from tokenmill.worker.sampler import _mix_seed

_DRAFT_STREAM = 0x6A09E667F3BCC909  # seeded draft sampling: a stream apart from the target's noise


@dataclasses.dataclass
class _DraftState:
    """Attributes:
    num_valid: positions ``[0, num_valid)`` hold draft KV computed from the request's verified tokens.
    fed: draft tokens the draft fed itself at positions ``num_valid ..`` in its last proposal.
    """

    num_valid: int = 0
    fed: list[int] = dataclasses.field(default_factory=list)


class DraftModelProposer:
    """Owns the draft model, its KV cache and per-request draft positions.

    Args:
        model_config: the draft's configuration (vocabulary already checked against the target's).
        num_speculative_tokens: K.
        block_size: the target's block size.
        device: where the model runs.
        attn_backend: the target's attention backend class (the draft's layers use it too).
        kv_cache_dtype: element type of the draft's KV cache (``None``: the draft model's dtype); the target's
            ``--kv-cache-dtype`` applies to both.
    """

    def __init__(
        self, model_config: ModelConfig, num_speculative_tokens: int, block_size: int, device: torch.device,
        attn_backend: type, kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model_config = model_config
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self.attn_backend = attn_backend
        self.dtype = str_to_dtype(model_config.dtype)
        self.kv_cache_dtype = kv_cache_dtype or self.dtype
        self.model: torch.nn.Module | None = None
        self.attn_layers: list[Attention] = []
        self.states: dict[str, _DraftState] = {}
        # req_id -> [k, V] float32 distributions the last drafts were drawn from (random requests only)
        self.draft_probs: dict[str, torch.Tensor] = {}

    def load_model(self, process_weights: bool = True) -> None:
        """Build and load the draft model and attach the platform's linear method (see ``ModelRunner``)."""
        self.model = get_model(self.model_config, self.device)
        attach_linear_method(self.model, process=process_weights)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]

    def kv_cache_bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.attn_backend, self.attn_layers, self.block_size, self.kv_cache_dtype)

    def model_memory_bytes(self) -> int:
        assert self.model is not None
        return sum(t.numel() * t.element_size() for t in self.model.parameters() if not t.is_meta)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        allocate_kv_caches(self.attn_backend, self.attn_layers, num_blocks, self.block_size, self.kv_cache_dtype,
                           self.device)

    def remove_requests(self, req_ids) -> None:
        for req_id in req_ids:
            self.states.pop(req_id, None)
            self.draft_probs.pop(req_id, None)

    def take_draft_probs(self, req_id: str) -> torch.Tensor | None:
        return self.draft_probs.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState], max_drafts: list[int]) -> list[list[int]]:
        """Draft up to ``max_drafts[i]`` tokens after ``states[i].token_ids`` (all verified tokens).

        Returns:
            per request, the draft ids (as many as ``max_drafts[i]``, capped by the request's allocated KV slots).
        """
        assert self.model is not None
        todo: list[tuple[int, CachedRequestState, int, int]] = []  # index, state, first missing position, k
        for i, (state, k) in enumerate(zip(states, max_drafts)):
            self.draft_probs.pop(state.req_id, None)
            length = len(state.token_ids)
            # KV slots the scheduler reserved: positions up to length - 1 + (k - 1) are written
            k = min(k, len(state.block_ids) * self.block_size - length + 1)
            if k <= 0:
                continue
            ds = self.states.setdefault(state.req_id, _DraftState())
            matched = 0
            for j, t in enumerate(ds.fed):
                pos = ds.num_valid + j
                if pos >= length or state.token_ids[pos] != t:
                    break
                matched += 1
            start = min(ds.num_valid + matched, length - 1)
            todo.append((i, state, start, k))
        drafts: list[list[int]] = [[] for _ in states]
        if not todo:
            return drafts
        # 1. catch-up pass: positions [start, length) of every request, logits at each last one
        cur = [dataclasses.replace(s, num_computed_tokens=start) for _, s, start, _ in todo]
        counts = [len(s.token_ids) - start for _, s, start, _ in todo]
        seqs = [list(s.token_ids) for _, s, _, _ in todo]
        logits = self._forward(cur, counts)
        active = list(range(len(todo)))
        for step in range(max(k for *_, k in todo)):
            toks, probs = self._draw(logits, [todo[a][1] for a in active], step)
            nxt = []
            for row, a in enumerate(active):
                i, state, _, k = todo[a]
                drafts[i].append(toks[row])
                seqs[a].append(toks[row])
                if probs is not None and probs[row] is not None:
                    prev = self.draft_probs.get(state.req_id)
                    p = probs[row].unsqueeze(0)
                    self.draft_probs[state.req_id] = p if prev is None else torch.cat([prev, p])
                if len(drafts[i]) < k:
                    nxt.append(a)
            active = nxt
            if not active:
                break
            # 2. feed the newest draft of each request still drafting
            cur = [
                dataclasses.replace(todo[a][1], token_ids=seqs[a], num_computed_tokens=len(seqs[a]) - 1)
                for a in active
            ]
            logits = self._forward(cur, [1] * len(active))
        for i, state, _, _ in todo:
            ds = self.states[state.req_id]
            ds.num_valid = len(state.token_ids)
            ds.fed = drafts[i][:-1]  # the last draft was never fed
        return drafts

    def _forward(self, states: list[CachedRequestState], counts: list[int]) -> torch.Tensor:
        assert self.model is not None
        batch = build_batch_inputs(states, counts, self.block_size, self.device)
        with set_forward_context(batch.attn_metadata):
            hidden = self.model(batch.input_ids, batch.positions)
        return self.model.compute_logits(hidden[batch.logits_indices]).float()

    def _draw(
        self, logits: torch.Tensor, states: list[CachedRequestState], step: int
    ) -> tuple[list[int], list[torch.Tensor | None] | None]:
        """One draft token per row: argmax for greedy requests, else a sample of ``softmax(logits / T)``."""
        greedy = logits.argmax(dim=-1)
        temps = [s.sampling_params.temperature for s in states]
        if all(s.sampling_params.is_greedy for s in states):
            return greedy.tolist(), None
        temp = torch.tensor([max(t, SAMPLING_EPS) for t in temps], dtype=torch.float32, device=logits.device)
        probs = torch.softmax(logits / temp.unsqueeze(1), dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, s in enumerate(states):
            seed = s.sampling_params.seed
            if seed is not None and not s.sampling_params.is_greedy:
                gen = torch.Generator(device=logits.device)
                gen.manual_seed(_mix_seed(seed ^ _DRAFT_STREAM, s.num_output_tokens + step))
                noise[row].exponential_(generator=gen)
        sampled = torch.where(temp < SAMPLING_EPS, greedy, (probs / noise).argmax(dim=-1)).tolist()
        return sampled, [None if s.sampling_params.is_greedy else probs[row] for row, s in enumerate(states)]
