"""tokenmill's attention reference for the conformance kit: multi-step paged scenarios and float64 attention.

A scenario is a few engine-like steps on one KV cache (fresh prefills, a chunk on top of a cached prefix, a
request whose first blocks are another request's blocks (a prefix-cache hit), decodes, and mixed steps of all of
these), with the queries, keys and values of every token drawn up front. Each step's expected output is computed
in float64 from the un-paged keys and values of each request's whole context, so a backend that writes a key to
the wrong slot, reads the wrong block, masks the wrong positions or uses the wrong scale does not match.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tokenmill.attention.backend import AttentionMetadata


@dataclass(frozen=True)
class Variant:
    """One attention configuration: heads, head size, scale and options."""

    label: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float | None = None  # None: head_size ** -0.5
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    @property
    def softmax_scale(self) -> float:
        return self.head_size**-0.5 if self.scale is None else self.scale


@dataclass
class Request:
    """A request of a scenario: all its tokens' q/k/v (``[L, H, D]``, float64) and its block table."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    blocks: list[int]


@dataclass
class Step:
    """One step: ``(request, first position, number of tokens)`` per scheduled request, in batch order."""

    label: str
    chunks: list[tuple[str, int, int]]


@dataclass
class Scenario:
    block_size: int
    num_blocks: int
    requests: dict[str, Request]
    steps: list[Step]
    shared: dict[str, tuple[str, int]] = field(default_factory=dict)  # request -> (owner, tokens shared)


def reference_attention(req: Request, start: int, count: int, variant: Variant,
                        spans: list[tuple[int, int]] = ()) -> torch.Tensor:
    """float64 attention of request ``req``'s tokens ``start .. start + count - 1`` over positions
    ``0 .. start + count - 1``: ``[count, Hq * D]``. Within each ``(first, end)`` of ``spans`` queries also see
    the span's later keys (``AttentionMetadata.mm_prefix_ranges``), still within a sliding window."""
    end = start + count
    q, k, v = req.q[start:end], req.k[:end], req.v[:end]  # [n, Hq, D], [L, Hkv, D]
    group = variant.num_heads // variant.num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * variant.softmax_scale
    if variant.logits_soft_cap is not None:
        cap = variant.logits_soft_cap
        scores = torch.tanh(scores / cap) * cap
    rows = torch.arange(start, end).unsqueeze(1)
    cols = torch.arange(end).unsqueeze(0)
    mask = cols <= rows
    for a, b in spans:
        mask |= (rows >= a) & (rows < b) & (cols >= a) & (cols < b)
    if variant.sliding_window is not None:
        mask &= cols > rows - variant.sliding_window
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out.reshape(count, -1)


def reference_encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant) -> torch.Tensor:
    """float64 bidirectional attention of one whole sequence: every query sees every key. ``q`` ``[L, Hq, D]``,
    ``k`` / ``v`` ``[L, Hkv, D]`` -> ``[L, Hq * D]``."""
    group = variant.num_heads // variant.num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * variant.softmax_scale
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out.reshape(q.shape[0], -1)


def make_scenario(variant: Variant, block_size: int, dtype: torch.dtype, seed: int) -> Scenario:
    """The standard scenario (three steps, four requests):

    1. fresh prefills: ``A`` (``2 * block_size + 3`` tokens), ``B`` (6 tokens);
    2. mixed: ``A`` decodes, ``B`` continues with a 5-token chunk on its cached prefix, ``C`` shares ``A``'s
       first two full blocks (a prefix-cache hit: the same block ids) and computes 4 tokens after them, ``D``
       prefills 1 token;
    3. every request decodes one token (a pure decode step).

    Block ids are shuffled, ``B``'s first block directly follows ``A``'s last one (a slot written one too far
    lands in another request), and the values are rounded to ``dtype`` (the reference uses the rounded values).
    """
    g = torch.Generator().manual_seed(seed)
    bs = block_size
    len_a = 2 * bs + 3
    lengths = {"A": len_a + 2, "B": 6 + 5 + 1, "C": 2 * bs + 4 + 1, "D": 1 + 1}
    need = {n: -(-length // bs) for n, length in lengths.items()}
    need["C"] -= 2  # its first two blocks are A's
    num_blocks = sum(need.values()) + 4
    ids = (torch.randperm(num_blocks - 2, generator=g) + 1).tolist()  # block 0 and the last stay unused
    blocks: dict[str, list[int]] = {}
    a_ids = ids[: need["A"]]
    rest = [i for i in ids if i not in a_ids and i != a_ids[-1] + 1]
    blocks["A"] = a_ids
    b_first = a_ids[-1] + 1 if a_ids[-1] + 1 < num_blocks - 1 and a_ids[-1] + 1 not in a_ids else rest.pop()
    blocks["B"] = [b_first] + [rest.pop() for _ in range(need["B"] - 1)]
    blocks["C"] = a_ids[:2] + [rest.pop() for _ in range(need["C"])]
    blocks["D"] = [rest.pop() for _ in range(need["D"])]
    h, hkv, d = variant.num_heads, variant.num_kv_heads, variant.head_size

    def draw(n: int, heads: int) -> torch.Tensor:
        return torch.randn(n, heads, d, generator=g).to(dtype).double()

    requests = {}
    for name, length in lengths.items():
        requests[name] = Request(name, draw(length, h), draw(length, hkv), draw(length, hkv), blocks[name])
    shared = 2 * bs
    requests["C"].k[:shared] = requests["A"].k[:shared]  # the same tokens: the same keys and values
    requests["C"].v[:shared] = requests["A"].v[:shared]
    steps = [
        Step("fresh prefills", [("A", 0, len_a), ("B", 0, 6)]),
        Step("mixed: decode + chunk on a cached prefix + prefix-cache hit + 1-token prefill",
             [("A", len_a, 1), ("B", 6, 5), ("C", shared, 4), ("D", 0, 1)]),
        Step("decode only", [("A", len_a + 1, 1), ("B", 11, 1), ("C", shared + 4, 1), ("D", 1, 1)]),
    ]
    return Scenario(bs, num_blocks, requests, steps, {"C": ("A", shared)})


def mm_prefix_spans(scenario: Scenario) -> dict[str, list[tuple[int, int]]]:
    """Bidirectional spans for the standard scenario's requests (``mm_prefix_ranges``): ``A``'s within its
    fresh prefill, two of ``B``'s (one per prefill chunk), and ``C``'s starting in the prefix it shares with
    ``A`` (a prefix-cache hit inside an image) and ending inside its chunk; the later steps see them too,
    wholly in the past. Each span ends within the step that reaches it (the scheduler's rule)."""
    bs = scenario.block_size
    return {"A": [(1, bs + 2)], "B": [(2, 5), (7, 10)], "C": [(2 * bs - 2, 2 * bs + 3)]}


def step_inputs(
    scenario: Scenario, step: Step, variant: Variant, dtype: torch.dtype, device: torch.device,
    spans: dict[str, list[tuple[int, int]]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, list[torch.Tensor]]:
    """``(query [T, Hq*D], key [T, Hkv*D], value, metadata, expected outputs per chunk)`` of one step;
    ``spans``: each request's ``mm_prefix_ranges`` (``None``: the metadata has none)."""
    bs = scenario.block_size
    qs, ks, vs, slots, expected = [], [], [], [], []
    qsl, seq_lens = [0], []
    width = max(len(scenario.requests[n].blocks) for n, _, _ in step.chunks) + 1
    table = torch.zeros(len(step.chunks), width, dtype=torch.int32)
    for i, (name, start, count) in enumerate(step.chunks):
        req = scenario.requests[name]
        end = start + count
        qs.append(req.q[start:end].reshape(count, -1))
        ks.append(req.k[start:end].reshape(count, -1))
        vs.append(req.v[start:end].reshape(count, -1))
        pos = torch.arange(start, end)
        ids = torch.tensor(req.blocks, dtype=torch.long)
        slots.append(ids[pos // bs] * bs + pos % bs)
        table[i, : len(req.blocks)] = ids.int()
        qsl.append(qsl[-1] + count)
        seq_lens.append(end)
        expected.append(reference_attention(req, start, count, variant, (spans or {}).get(name, [])))
    q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
    md = AttentionMetadata(
        num_actual_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.cat(slots).to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_size=bs,
        mm_prefix_ranges=None if spans is None else [spans.get(name, []) for name, _, _ in step.chunks],
    )

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts).to(dtype).to(device)

    return cat(qs), cat(ks), cat(vs), md, expected


def blocks_needed_next(scenario: Scenario, step: Step, variant: Variant) -> set[int]:
    """Block ids a correct backend may read in ``step``: for each request, the blocks holding positions its
    queries see (the window's only, with a sliding window)."""
    bs = scenario.block_size
    needed: set[int] = set()
    for name, start, count in step.chunks:
        req = scenario.requests[name]
        first = 0 if variant.sliding_window is None else max(0, start - variant.sliding_window + 1)
        for p in range(first, start + count):
            needed.add(req.blocks[p // bs])
    return needed


def tolerance(dtype: torch.dtype) -> float:
    """Largest accepted ``max |out - ref|`` for unit-variance inputs in ``dtype`` (outputs are averages of
    values, so of order one)."""
    return {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}.get(dtype, 3e-2)


def standard_variants(supports_sliding_window: bool, supports_logits_soft_cap: bool) -> list[Variant]:
    """Grouped-query attention with the default scale, multi-head attention with a scale that is not
    ``D ** -0.5`` (a backend ignoring ``scale`` fails it), and the window / soft-cap options a backend claims."""
    out = [
        Variant("GQA 4/2 heads, D 32", 4, 2, 32),
        Variant("MHA 2 heads, D 64, scale 0.3", 2, 2, 64, scale=0.3),
    ]
    if supports_sliding_window:
        out.append(Variant("GQA, sliding window 5", 4, 2, 32, sliding_window=5))
    if supports_logits_soft_cap:
        out.append(Variant("GQA, logit soft cap 3.0", 4, 2, 32, logits_soft_cap=3.0))
    return out


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.double().cpu() - b.double().cpu()).abs()
    return math.inf if diff.isnan().any() else float(diff.max()) if diff.numel() else 0.0
