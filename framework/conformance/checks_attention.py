"""Contract items about the attention backend: it resolves, writes the slot mapping exactly, and attends like
tokenmill's float64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata
from tokenmill.attention.kv_cache_quant import (
    attention_error_bound,
    is_quantized_kv_dtype,
    kv_cache_row_size,
    quantize_kv,
    row_scales,
)
from tokenmill.conformance import reference as ref
from tokenmill.conformance.target import ConformanceTarget, ContractFailure, ItemSkipped
from tokenmill.dtypes import TORCH_DTYPES, kv_cache_dtype_to_torch

BLOCK_SIZES = (4, 16)
GARBAGE = 8.0  # unwritten slots of used blocks hold uniform(-8, 8): finite, and wrong if ever attended to

# probe sizes, distinct so that every dimension of a layout can be told apart
_PROBE = {"num_blocks": 7, "block_size": 3, "num_kv_heads": 5, "head_size": 11}


@dataclass(frozen=True)
class Layout:
    """Where the backend's cache shape puts each role: indices into the shape, or ``None`` if unknown."""

    kv: int
    block: int
    offset: int
    head: int
    dim: int

    def canonical(self, cache: torch.Tensor) -> torch.Tensor:
        """A view ``[2, num_blocks, block_size, Hkv, D]`` of ``cache``."""
        return cache.permute(self.kv, self.block, self.offset, self.head, self.dim)


def probe_layout(backend: type[AttentionBackend]) -> Layout | None:
    """The roles of the cache dimensions, when the shape is a permutation of ``(2, blocks, offsets, heads,
    dims)`` (both of tokenmill's layouts are); ``None`` for a layout the kit cannot read (a packed one)."""
    shape = tuple(backend.get_kv_cache_shape(**_PROBE))
    if len(shape) != 5 or sorted(shape) != sorted((2, *_PROBE.values())):
        return None
    return Layout(shape.index(2), shape.index(7), shape.index(3), shape.index(5), shape.index(11))


def _backend(t: ConformanceTarget) -> type[AttentionBackend]:
    return t.backend_choice().backend_cls


def check_backend(t: ConformanceTarget) -> None:
    """The platform's attention backend name resolves through the registry to an AttentionBackend whose impl
    is an AttentionImpl; the cache shape holds the blocks it is asked for and grows linearly with them."""
    choice = t.backend_choice()
    backend = choice.backend_cls
    t.note(choice.describe())
    impl_cls = backend.get_impl_cls()
    if not (isinstance(impl_cls, type) and issubclass(impl_cls, AttentionImpl)):
        raise ContractFailure(f"{choice.name}.get_impl_cls() returned {impl_cls!r}, not an AttentionImpl subclass")
    sizes = []
    for nb in (3, 6):
        shape = backend.get_kv_cache_shape(nb, 16, 2, 32)
        if not all(isinstance(d, int) and d > 0 for d in shape):
            raise ContractFailure(f"get_kv_cache_shape returned {shape!r}, not a tuple of positive ints")
        n = 1
        for d in shape:
            n *= d
        sizes.append(n)
    if sizes[0] < 2 * 3 * 16 * 2 * 32 or sizes[1] != 2 * sizes[0]:
        raise ContractFailure(f"get_kv_cache_shape holds {sizes[0]} elements for 3 blocks and {sizes[1]} for 6; "
                              "it must hold at least 2 x blocks x block_size x heads x head_size and grow "
                              "linearly with the blocks (the engine sizes the cache from it)")
    layout = probe_layout(backend)
    t.note(f"layout {backend.get_kv_cache_shape(**_PROBE)} for (blocks 7, block_size 3, heads 5, head_size 11): "
           + ("readable by the kit" if layout else "not a permutation of [2, blocks, offsets, heads, dims]"))
    flags = [f for f in ("supports_graph_capture", "supports_compile", "supports_sliding_window",
                         "supports_logits_soft_cap", "supports_encoder_only") if getattr(backend, f, False)]
    t.note("claims: " + (", ".join(flags) or "nothing optional"))


def _dtypes(t: ConformanceTarget) -> list[torch.dtype]:
    names = ["float32"] if "float32" in t.run_cls.supported_dtypes else []
    if t.run_cls.default_dtype not in names:
        names.append(t.run_cls.default_dtype)
    return [TORCH_DTYPES[n] for n in names]


def _new_cache(backend: type[AttentionBackend], num_blocks: int, block_size: int, variant: ref.Variant,
               dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Garbage in ``dtype``; a quantized ``dtype`` needs a layout whose last dimension is the row (the garbage is
    then quantized rows, :func:`tokenmill.attention.kv_cache_quant.quantize_kv`)."""
    row = kv_cache_row_size(variant.head_size, dtype)
    shape = tuple(backend.get_kv_cache_shape(num_blocks, block_size, variant.num_kv_heads, row))
    g = torch.Generator().manual_seed(seed)
    if is_quantized_kv_dtype(dtype):
        garbage = (torch.rand(*shape[:-1], variant.head_size, generator=g) * 2 - 1) * GARBAGE
        return quantize_kv(garbage, dtype).contiguous().to(device)
    return ((torch.rand(shape, generator=g) * 2 - 1) * GARBAGE).to(dtype).to(device)


def _poison_blocks(cache: torch.Tensor, layout: Layout | None, keep: set[int]) -> int:
    """NaN into every block not in ``keep`` (when the layout is readable); returns how many."""
    if layout is None:
        return 0
    view = layout.canonical(cache)
    count = 0
    for b in range(view.shape[1]):
        if b not in keep:
            # an int8 row reads back as NaN through its scale
            (row_scales(view[:, b]) if cache.dtype == torch.int8 else view[:, b]).fill_(float("nan"))
            count += 1
    return count


def _impl(backend: type[AttentionBackend], variant: ref.Variant) -> AttentionImpl:
    options: dict[str, object] = {}
    if variant.sliding_window is not None:
        options["sliding_window"] = variant.sliding_window
    if variant.logits_soft_cap is not None:
        options["logits_soft_cap"] = variant.logits_soft_cap
    return backend.get_impl_cls()(variant.num_heads, variant.head_size, variant.softmax_scale,
                                  variant.num_kv_heads, **options)


# (item, backend class, dtypes, device type) -> (notes, failure message or None): the same backend class checked
# twice in one process (the CUDA and ROCm plugins both choose TRITON_PAGED) gives the same answer.
_MEMO: dict[tuple, tuple[list[str], str | None]] = {}


def _memoized(t: ConformanceTarget, item: str, fn) -> None:  # noqa: ANN001
    key = (item, _backend(t), tuple(_dtypes(t)), t.device.type)
    if key not in _MEMO:
        start = len(t.notes)
        try:
            fn(t)
        except ContractFailure as exc:
            _MEMO[key] = (t.notes[start:], str(exc))
            raise
        _MEMO[key] = (t.notes[start:], None)
        return
    notes, failure = _MEMO[key]
    t.notes.extend(notes)
    t.note("(the same backend class, dtypes and device were checked earlier in this process; result reused)")
    if failure is not None:
        raise ContractFailure(failure)


def check_reference(t: ConformanceTarget) -> None:
    """For every block size, dtype and variant: the three steps of the standard scenario
    (:func:`tokenmill.conformance.reference.make_scenario`) match the float64 reference, with unused blocks
    poisoned with NaN (and, with a sliding window, blocks wholly outside every window)."""
    _memoized(t, "attention.reference", _check_reference)


def check_mm_prefix(t: ConformanceTarget) -> None:
    """For a backend that declares ``supports_mm_prefix``: :func:`check_reference`'s steps (model dtypes) with
    bidirectional spans in ``mm_prefix_ranges`` (:func:`tokenmill.conformance.reference.mm_prefix_spans`)."""
    if not getattr(_backend(t), "supports_mm_prefix", False):
        raise ItemSkipped(f"the attention backend {t.backend_choice().name} does not declare supports_mm_prefix: "
                          "models with bidirectional image attention (Gemma 3) run on TORCH_PAGED instead")
    _memoized(t, "attention.mm_prefix", lambda target: _check_reference(target, with_spans=True))


def _check_reference(t: ConformanceTarget, with_spans: bool = False) -> None:
    backend = _backend(t)
    layout = probe_layout(backend)
    variants = ref.standard_variants(getattr(backend, "supports_sliding_window", False),
                                     getattr(backend, "supports_logits_soft_cap", False))
    checked = 0
    # (query dtype, cache dtype, block sizes): each model dtype over its own cache, then float32 queries over
    # every reduced cache dtype the platform supports (--kv-cache-dtype), within the cache dtype's tolerance.
    # Then float32 queries over each quantized cache the backend lists, within the quantization error bound
    # (tokenmill.attention.kv_cache_quant.attention_error_bound), where the layout ends in the row.
    runs = [(dtype, dtype, BLOCK_SIZES) for dtype in _dtypes(t)]
    if torch.float32 in _dtypes(t) and not with_spans:
        runs += [(torch.float32, TORCH_DTYPES[n], BLOCK_SIZES[-1:]) for n in ("bfloat16", "float16")
                 if n in t.run_cls.supported_dtypes]
        quantized = tuple(getattr(backend, "supported_quantized_kv_cache_dtypes", ()))
        if quantized and layout is not None and layout.dim == 4:
            runs += [(torch.float32, kv_cache_dtype_to_torch(n), BLOCK_SIZES[-1:]) for n in quantized]
        elif quantized:
            t.note(f"quantized KV caches {', '.join(quantized)} not checked: the layout does not end in the row")
    with torch.inference_mode():
        for dtype, cache_dtype, block_sizes in runs:
            for bs in block_sizes:
                for vi, variant in enumerate(variants):
                    scenario = ref.make_scenario(variant, bs, dtype, seed=100 * bs + vi)
                    spans = ref.mm_prefix_spans(scenario) if with_spans else None
                    impl = _impl(backend, variant)
                    cache = _new_cache(backend, scenario.num_blocks, bs, variant, cache_dtype, t.device,
                                       seed=bs + vi)
                    used = {b for r in scenario.requests.values() for b in r.blocks}
                    _poison_blocks(cache, layout, used)
                    for si, step in enumerate(scenario.steps):
                        if si > 0 and variant.sliding_window is not None:
                            _poison_blocks(cache, layout, ref.blocks_needed_next(scenario, step, variant)
                                           | _blocks_written(scenario, step))
                        q, k, v, md, expected = ref.step_inputs(scenario, step, variant, dtype, t.device, spans)
                        out = impl.forward(q, k, v, cache, md)
                        bounds = None
                        if is_quantized_kv_dtype(cache_dtype):
                            bounds = [attention_error_bound(r.q[a:a + c], r.k[:a + c], r.v[:a + c], cache_dtype,
                                                            variant.softmax_scale).reshape(c, -1)
                                      for r, a, c in ((scenario.requests[n], a, c) for n, a, c in step.chunks)]
                        _compare(out, expected, step, md, dtype, bs, variant, t, cache_dtype, bounds)
                        checked += 1
    t.note(f"{checked} steps checked{' with bidirectional spans' if with_spans else ''}: block sizes {BLOCK_SIZES}, "
           "query / cache dtypes "
           f"{', '.join(_name(d) + ('' if d == c else ' / ' + _name(c)) for d, c, _ in runs)}, variants: "
           + "; ".join(v.label for v in variants))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _blocks_written(scenario: ref.Scenario, step: ref.Step) -> set[int]:
    bs = scenario.block_size
    return {scenario.requests[n].blocks[p // bs] for n, a, c in step.chunks for p in range(a, a + c)}


def _compare(out: torch.Tensor, expected: list[torch.Tensor], step: ref.Step, md: AttentionMetadata,
             dtype: torch.dtype, block_size: int, variant: ref.Variant, t: ConformanceTarget,
             cache_dtype: torch.dtype | None = None, bounds: list[torch.Tensor] | None = None) -> None:
    """``out`` against the float64 reference of each chunk: within the dtypes' tolerance, or with ``bounds``
    (a quantized cache's, ``[count, Hq * D]`` per chunk) within the bound plus float32's tolerance per element."""
    if out.shape != (md.num_actual_tokens, variant.num_heads * variant.head_size):
        raise ContractFailure(f"forward returned shape {tuple(out.shape)}, expected "
                              f"[{md.num_actual_tokens}, {variant.num_heads * variant.head_size}]")
    if out.dtype != dtype:
        raise ContractFailure(f"forward returned {out.dtype} for {dtype} inputs (the output has the query's dtype)")
    tol = max(ref.tolerance(dtype), ref.tolerance(cache_dtype or dtype))
    qsl = md.query_start_loc_cpu
    for i, (name, start, count) in enumerate(step.chunks):
        if bounds is not None:
            diff = (out[qsl[i] : qsl[i + 1]].double().cpu() - expected[i]).abs()
            if bool((diff <= bounds[i] + tol).all()):  # NaN fails
                continue
            err = float("inf") if bool(diff.isnan().any()) else float(diff.max())
            limit = f"the {_name(cache_dtype)} quantization bound (+{tol:g})"
        else:
            err = ref.max_abs_diff(out[qsl[i] : qsl[i + 1]], expected[i])
            limit = f"{tol:g}"
        if bounds is not None or not err <= tol:
            what = "NaN (it read a block it must not read)" if err == float("inf") else f"{err:.3g} > {limit}"
            raise ContractFailure(
                f"{t.backend_choice().name}, {_name(dtype)}"
                + (f" over a {_name(cache_dtype)} cache" if cache_dtype not in (None, dtype) else "")
                + f", block_size {block_size}, "
                f"variant '{variant.label}': step '{step.label}', request {name} (positions {start}..{start + count - 1}"
                f" of {start + count}): max |out - reference| = {what}"
            )


def check_kv_cache(t: ConformanceTarget) -> None:
    """One prefill step writes each token's key and value, per head, into exactly its slot of the slot mapping
    (slots scattered over shuffled blocks, including a block's last slot followed by the next block id's first)
    and changes nothing else; a backend that claims graph capture also writes nothing for a negative slot
    (the padding rows of a captured batch)."""
    _memoized(t, "kv_cache", _check_kv_cache)


def _check_kv_cache(t: ConformanceTarget) -> None:
    backend = _backend(t)
    layout = probe_layout(backend)
    variant = ref.Variant("GQA 4/2 heads, D 32", 4, 2, 32)
    bs, num_blocks = 4, 12
    name = "float32" if "float32" in t.run_cls.supported_dtypes else t.run_cls.default_dtype
    dtype = TORCH_DTYPES[name]
    blocks = [5, 9, 10, 2]  # 9 -> 10: a write one slot too far leaves block 9 for block 10
    seq = 15  # ends inside the last block
    g = torch.Generator().manual_seed(7)
    impl = _impl(backend, variant)
    h, hkv, d = variant.num_heads, variant.num_kv_heads, variant.head_size
    q = torch.randn(seq, h * d, generator=g).to(dtype)
    k = torch.randn(seq, hkv, d, generator=g).to(dtype)
    v = torch.randn(seq, hkv, d, generator=g).to(dtype)
    pos = torch.arange(seq)
    ids = torch.tensor(blocks)
    slots = ids[pos // bs] * bs + pos % bs
    md = AttentionMetadata(
        num_actual_tokens=seq,
        query_start_loc=torch.tensor([0, seq], dtype=torch.int32, device=t.device),
        seq_lens=torch.tensor([seq], dtype=torch.int32, device=t.device),
        block_table=torch.tensor([blocks + [0]], dtype=torch.int32, device=t.device),
        slot_mapping=slots.to(t.device),
        max_query_len=seq, max_seq_len=seq, query_start_loc_cpu=[0, seq], seq_lens_cpu=[seq], block_size=bs,
    )
    cache = _new_cache(backend, num_blocks, bs, variant, dtype, t.device, seed=3)
    before = cache.clone()
    with torch.inference_mode():
        impl.forward(q.to(t.device), k.reshape(seq, -1).to(t.device), v.reshape(seq, -1).to(t.device), cache, md)
    changed = (cache != before).cpu()
    expected_changes = seq * 2 * hkv * d
    if layout is None:
        n = int(changed.sum())
        t.note(f"layout not readable: checked only that {expected_changes} elements changed")
        if n != expected_changes:
            raise ContractFailure(f"a step of {seq} tokens changed {n} cache elements; exactly {expected_changes} "
                                  "(2 x tokens x kv heads x head size) may change")
    else:
        after = layout.canonical(cache).cpu()
        touched = layout.canonical(changed).any(dim=0).any(dim=-1).any(dim=-1)  # [blocks, offsets]
        written = {int(b) * bs + int(o) for b, o in touched.nonzero().tolist()}
        wanted = set(slots.tolist())
        if written != wanted:
            wrong = sorted(written - wanted)
            missing = sorted(wanted - written)
            detail = ""
            if missing:
                p = slots.tolist().index(missing[0])
                detail = (f"; token {p} belongs in slot {missing[0]} (block {missing[0] // bs}, offset "
                          f"{missing[0] % bs})")
            raise ContractFailure(f"the cache write went to the wrong slots: slots {wrong[:6]} changed that the "
                                  f"slot mapping does not name, and slots {missing[:6]} it names were not "
                                  f"written{detail}")
        for p, s in enumerate(slots.tolist()):
            kk, vv = after[0, s // bs, s % bs], after[1, s // bs, s % bs]
            if not (torch.equal(kk, k[p]) and torch.equal(vv, v[p])):
                raise ContractFailure(f"slot {s} holds the wrong data for token {p} (keys and values must be stored "
                                      "per KV head as given, keys in [0] and values in [1] of the layout)")
        t.note(f"{seq} tokens over blocks {blocks} (block size {bs}): exactly their slots written, keys and values "
               "per head in place")
    if getattr(backend, "supports_graph_capture", False):
        _check_negative_slots(t, backend, impl, variant, dtype)


def _check_negative_slots(t: ConformanceTarget, backend: type[AttentionBackend], impl: AttentionImpl,
                          variant: ref.Variant, dtype: torch.dtype) -> None:
    bs, n = 4, 4
    cache = _new_cache(backend, 6, bs, variant, dtype, t.device, seed=4)
    before = cache.clone()
    g = torch.Generator().manual_seed(8)
    q = torch.randn(n, variant.num_heads * variant.head_size, generator=g).to(dtype).to(t.device)
    k = torch.randn(n, variant.num_kv_heads * variant.head_size, generator=g).to(dtype).to(t.device)
    md = AttentionMetadata(
        num_actual_tokens=n,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=t.device),
        seq_lens=torch.ones(n, dtype=torch.int32, device=t.device),
        block_table=torch.zeros(n, 2, dtype=torch.int32, device=t.device),
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=t.device),
        max_query_len=1, max_seq_len=1, query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=[1] * n, block_size=bs,
    )
    with torch.inference_mode():
        impl.forward(q, k, k.clone(), cache, md)
    if not torch.equal(cache.isnan(), before.isnan()) or not torch.equal(cache.nan_to_num(), before.nan_to_num()):
        raise ContractFailure("a decode step whose slots are all -1 (graph padding rows) changed the cache; a "
                              "backend with supports_graph_capture must write nothing for a negative slot")
    t.note("negative slots (graph padding) write nothing")
