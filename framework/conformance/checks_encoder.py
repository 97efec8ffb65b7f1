"""Contract item about encoder-only (bidirectional) attention, for backends that declare
``supports_encoder_only``: embedding and cross-encoder models (BERT, XLM-RoBERTa) run only on those."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.conformance import reference as ref
from tokenmill.conformance.checks_attention import _backend, _dtypes, _impl, _memoized, _name
from tokenmill.conformance.target import ConformanceTarget, ContractFailure, ItemSkipped

# Whole sequences of one step: a single token, two lengths that share a padded batch in the torch backend's
# buckets, and one longer than a query tile of the Triton kernel under grouped-query attention (32 queries).
SEQUENCE_LENGTHS = (1, 9, 10, 40)


def check_encoder_only(t: ConformanceTarget) -> None:
    """For each dtype and the standard variants without window or soft cap: ``forward_encoder`` on a step of
    whole sequences of different lengths equals the float64 bidirectional reference per sequence (no token
    sees another sequence's), the profiling pass (no metadata) treats the batch as one sequence, and a
    sequence that continues an earlier step is refused with ``ValueError``."""
    backend = _backend(t)
    if not getattr(backend, "supports_encoder_only", False):
        raise ItemSkipped(f"the attention backend {t.backend_choice().name} does not declare "
                          "supports_encoder_only: encoder-only models are refused at start-up on it")
    _memoized(t, "attention.encoder_only", _check_encoder_only)


def _metadata(lengths: list[int], device: torch.device, context: int = 0) -> AttentionMetadata:
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    seq_lens = [n + context for n in lengths]
    return AttentionMetadata(
        num_actual_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.zeros(len(lengths), 1, dtype=torch.int32, device=device),
        slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.long, device=device),
        max_query_len=max(lengths),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_size=16,
    )


def _check_encoder_only(t: ConformanceTarget) -> None:
    backend = _backend(t)
    variants = ref.standard_variants(False, False)
    lengths = list(SEQUENCE_LENGTHS)
    total = sum(lengths)
    g = torch.Generator().manual_seed(7)
    checked = 0
    with torch.inference_mode():
        for dtype in _dtypes(t):
            tol = ref.tolerance(dtype)
            for variant in variants:
                impl = _impl(backend, variant)
                q, k, v = (torch.randn(total, heads, variant.head_size, generator=g, dtype=torch.float64)
                           for heads in (variant.num_heads, variant.num_kv_heads, variant.num_kv_heads))
                args = [x.to(dtype) for x in (q, k, v)]
                # the reference sees the values the backend sees (rounded to dtype)
                q64, k64, v64 = (x.double() for x in args)
                inputs = [x.reshape(total, -1).to(t.device) for x in args]
                out = impl.forward_encoder(*inputs, _metadata(lengths, t.device))
                if out.shape != (total, variant.num_heads * variant.head_size) or out.dtype != dtype:
                    raise ContractFailure(f"forward_encoder returned {tuple(out.shape)} {out.dtype} for "
                                          f"[{total}, {variant.num_heads * variant.head_size}] {dtype} queries")
                start = 0
                for n in lengths:
                    rows = slice(start, start + n)
                    want = ref.reference_encoder_attention(q64[rows], k64[rows], v64[rows], variant)
                    err = ref.max_abs_diff(out[rows], want)
                    if not err <= tol:
                        raise ContractFailure(
                            f"{t.backend_choice().name}, {_name(dtype)}, variant '{variant.label}': the {n}-token "
                            f"sequence at rows {start}..{start + n - 1} of a step of lengths {lengths}: "
                            f"max |out - reference| = {err:.3g} > {tol:g}")
                    start += n
                    checked += 1
                whole = impl.forward_encoder(*inputs, None)
                err = ref.max_abs_diff(whole, ref.reference_encoder_attention(q64, k64, v64, variant))
                if not err <= tol:
                    raise ContractFailure(f"{t.backend_choice().name}, {_name(dtype)}: the profiling pass "
                                          f"(attn_metadata None) is not one sequence of {total} tokens: "
                                          f"max |out - reference| = {err:.3g} > {tol:g}")
        variant = variants[0]
        impl = _impl(backend, variant)
        dtype = _dtypes(t)[0]
        q, k, v = (torch.randn(4, heads * variant.head_size, dtype=dtype).to(t.device)
                   for heads in (variant.num_heads, variant.num_kv_heads, variant.num_kv_heads))
        try:
            impl.forward_encoder(q, k, v, _metadata([4], t.device, context=3))
        except ValueError:
            pass
        else:
            raise ContractFailure("forward_encoder accepted a sequence that continues an earlier step (4 new "
                                  "tokens of a 7-token sequence); it must raise ValueError (chunked prefill is "
                                  "off for encoder models)")
    t.note(f"{checked} sequences checked: lengths {lengths}, dtypes {', '.join(_name(d) for d in _dtypes(t))}, "
           "variants: " + "; ".join(v.label for v in variants))
