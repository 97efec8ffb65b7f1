"""Rotary position embedding (RoPE, Su et al. 2021), "neox" layout (rotate the two halves of the rotary dims).

Rope types (the ``rope_type`` of a transformers ``rope_parameters`` / legacy ``rope_scaling`` dict; formulas as
in transformers' ``modeling_rope_utils``):

* ``default``: ``inv_freq[i] = theta ** (-2i / rotary_dim)``.
* ``linear`` (position interpolation, Chen et al. 2023): ``inv_freq / factor``.
* ``dynamic`` (dynamic NTK, bloc97/emozilla 2023): for ``L = max(p + 1, max_position_embeddings)`` the base
  becomes ``theta * (factor * L / max_position_embeddings - (factor - 1)) ** (d / (d - 2))``. transformers
  recomputes it from the longest position of each forward pass; here token ``p`` uses ``L = p + 1``, which equals
  transformers for every position inside the original context and for decoding beyond it (where transformers'
  ``L`` is the new token's ``p + 1``). A prompt longer than the original context is rotated per position
  instead of with the prompt length (a paged cache cannot re-rotate keys it holds).
* ``llama3`` (Meta's Llama 3.1 reference code): ``factor``, ``low_freq_factor``, ``high_freq_factor``,
  ``original_max_position_embeddings``.
* ``yarn`` (Peng et al. 2023, "YaRN: Efficient Context Window Extension"): ramp between interpolated and
  extrapolated frequencies (``beta_fast``, ``beta_slow``, ``truncate``) and cos/sin scaled by the attention
  factor ``0.1 * mscale * ln(factor) + 1`` (``mscale`` / ``mscale_all_dim`` ratio when both are given).
* ``longrope`` (Ding et al. 2024, Phi-3): ``inv_freq / short_factor`` for positions below
  ``original_max_position_embeddings`` and ``inv_freq / long_factor`` from there on (the same per-position rule
  as ``dynamic``), cos/sin scaled by ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``.

Partial rotary (``partial_rotary_factor``): only the first ``int(head_dim * factor)`` dims of each head rotate.
Per-layer theta (Gemma 3's local/global layers): :func:`get_rope` takes the layer type, or explicit parameters.

The cos/sin rows of a step are looked up once per forward pass when the model calls :meth:`begin_step`
(``tokenmill.layers.DecoderModel`` does) and dropped at :meth:`end_step`; nothing is kept between steps, so a
device graph captured around a forward pass records the lookup itself.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from tokenmill.layers.custom_op import CustomOp, resolve_custom_op

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_parameters_of(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rotary parameters of a transformers config as one flat dict.

    Reads v5 ``rope_parameters`` (flat, or nested by layer type as Gemma 3 does: ``layer_type`` picks the
    entry, ``"full_attention"`` by default), legacy ``rope_scaling`` + ``rope_theta``, and top-level
    ``partial_rotary_factor`` / ``original_max_position_embeddings``. The result always has ``rope_type``,
    ``rope_theta``, ``partial_rotary_factor`` and ``max_position_embeddings``.
    """
    raw = getattr(hf_config, "rope_parameters", None) or {}
    if any(isinstance(v, dict) for v in raw.values()):
        raw = raw.get(layer_type or "full_attention") or raw.get("full_attention") or {}
    params = dict(raw)
    legacy = getattr(hf_config, "rope_scaling", None)
    if isinstance(legacy, dict) and legacy is not raw and not any(isinstance(v, dict) for v in legacy.values()):
        for k, v in legacy.items():
            params.setdefault(k, v)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    max_pe = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    params["max_position_embeddings"] = max_pe
    if params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = (
            getattr(hf_config, "original_max_position_embeddings", None) or max_pe or None
        )
    return params


def _yarn_inv_freq(inv: torch.Tensor, dim: int, base: float, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = p.get("factor")
    orig = float(p["original_max_position_embeddings"])
    if factor is None:
        factor = p["max_position_embeddings"] / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (inv / factor) * (1 - extrapolation) + inv * extrapolation, float(attention)


def _longrope(inv: torch.Tensor, positions: torch.Tensor, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    orig = int(p["original_max_position_embeddings"])
    factor = p.get("factor")
    if factor is None:
        factor = p["max_position_embeddings"] / orig
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    short = torch.tensor(p["short_factor"], dtype=torch.float64)
    long = torch.tensor(p["long_factor"], dtype=torch.float64)
    if short.numel() != inv.numel() or long.numel() != inv.numel():
        raise ValueError(f"rope_parameters: longrope short_factor/long_factor need {inv.numel()} entries "
                         f"(rotary_dim / 2), got {short.numel()} and {long.numel()}")
    per_pos = torch.where((positions >= orig).unsqueeze(1), inv / long, inv / short)  # [P, rot/2]
    return per_pos, float(attention)


def rotary_cos_sin(
    rotary_dim: int, max_position: int, base: float, params: dict[str, Any] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_position, rotary_dim // 2]`` float32 (attention factor included), computed in
    float64.

    Raises:
        ValueError: unknown rope type or missing parameters (the message names ``rope_parameters``).
    """
    p = dict(params or {})
    rope_type = p.get("rope_type") or p.get("type") or "default"
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    t = torch.arange(max_position, dtype=torch.float64)
    attention = 1.0
    try:
        if rope_type == "default":
            freqs = torch.outer(t, inv)
        elif rope_type == "linear":
            freqs = torch.outer(t, inv / float(p["factor"]))
        elif rope_type == "dynamic":
            factor, max_pe = float(p["factor"]), float(p["max_position_embeddings"])
            length = torch.clamp(t + 1, min=max_pe)
            scaled = base * ((factor * length / max_pe) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
            exps = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
            freqs = t.unsqueeze(1) / scaled.unsqueeze(1) ** exps.unsqueeze(0)
        elif rope_type == "llama3":
            factor = float(p["factor"])
            low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
            old_len = float(p["original_max_position_embeddings"])
            wavelen = 2 * math.pi / inv
            smooth = (old_len / wavelen - low) / (high - low)
            scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
            mid = (1 - smooth) * scaled / factor + smooth * scaled
            is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
            freqs = torch.outer(t, torch.where(is_mid, mid, scaled))
        elif rope_type == "yarn":
            yarn_inv, attention = _yarn_inv_freq(inv, rotary_dim, base, p)
            freqs = torch.outer(t, yarn_inv)
        elif rope_type == "longrope":
            per_pos, attention = _longrope(inv, t, p)
            freqs = t.unsqueeze(1) * per_pos
        else:
            raise ValueError(f"rope_parameters: rope type {rope_type!r} is not supported "
                             f"(supported: {', '.join(ROPE_TYPES)})")
    except KeyError as exc:
        raise ValueError(f"rope_parameters: rope type {rope_type!r} needs {exc.args[0]!r}") from None
    return (freqs.cos() * attention).float(), (freqs.sin() * attention).float()


class RotaryEmbedding(CustomOp):
    """Applies RoPE to query and key tensors of a flattened batch. Custom op ``rotary_embedding``: a
    replacement keeps the constructor, the ``cos_cache`` / ``sin_cache`` buffers and :meth:`lookup` (the
    per-step rows), and overrides ``forward``.

    Args:
        head_size: D.
        rotary_dim: leading dims of each head that rotate (``== head_size`` unless partial rotary).
        max_position: positions precomputed.
        base: theta.
        scaling: the rope parameters (:func:`rope_parameters_of`), or ``None`` for default RoPE.
    """

    def __init__(
        self, head_size: int, rotary_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
            raise ValueError(f"rotary_dim must be even and in (0, head_size={head_size}], got {rotary_dim}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        cos, sin = rotary_cos_sin(rotary_dim, max_position, base, scaling)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows ``[T, 1, rotary_dim // 2]`` for ``positions`` ``[T]``."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    def begin_step(self, positions: torch.Tensor) -> None:
        """Look up this forward pass's rows once for every layer sharing this module (eager mode only)."""
        self._step = (positions, *self.lookup(positions))

    def end_step(self) -> None:
        self._step = None

    op_name = "rotary_embedding"

    def step_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's cos/sin rows for ``positions`` (looked up once per forward pass, see
        :meth:`begin_step`): ``[T, 1, rotary_dim // 2]`` float32 each."""
        if torch.compiler.is_compiling():  # traced: the compiler fuses the lookup into the rotation
            return self.lookup(positions)
        step = self._step
        return (step[1], step[2]) if step is not None and step[0] is positions else self.lookup(positions)

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[T]`` int64; ``query`` ``[T, Hq*D]``, ``key`` ``[T, Hkv*D]`` (model dtype); returns
        rotated copies (same shapes and dtype; the rotation runs in float32)."""
        cos, sin = self.step_cos_sin(positions)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = x.view(t, -1, self.head_size)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        x1, x2 = rot[..., :half].float(), rot[..., half:].float()
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        if rest.shape[-1]:
            out = torch.cat((out, rest), dim=-1)
        return out.reshape(t, -1)


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(
    head_size: int,
    max_position: int,
    hf_config: Any = None,
    rotary_dim: int | None = None,
    *,
    layer_type: str | None = None,
    base: float | None = None,
    rope_parameters: dict[str, Any] | None = None,
) -> RotaryEmbedding:
    """RotaryEmbedding from a transformers config (see :func:`rope_parameters_of`) or explicit parameters.

    Args:
        head_size: D.
        max_position: positions to precompute (the engine's ``max_model_len`` or more).
        hf_config: the model's config; ``layer_type`` picks per-layer-type parameters (Gemma 3).
        rotary_dim: overrides ``int(head_size * partial_rotary_factor)``.
        base: overrides the config's ``rope_theta``.
        rope_parameters: used instead of the config's.

    Layers with the same settings share one module (one cos/sin table, looked up once per step).

    Raises:
        ValueError: unsupported rope type or invalid rotary dim.
    """
    params = dict(rope_parameters) if rope_parameters is not None else rope_parameters_of(hf_config, layer_type)
    theta = float(base if base is not None else params.get("rope_theta") or 10000.0)
    if rotary_dim is None:
        rotary_dim = int(head_size * float(params.get("partial_rotary_factor") or 1.0))
    impl, _ = resolve_custom_op(RotaryEmbedding.op_name, RotaryEmbedding)
    key = (head_size, rotary_dim, max_position, theta, repr(sorted(params.items())), torch.get_default_device(), impl)
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = RotaryEmbedding(head_size, rotary_dim, max_position, theta, params)
        _ROPE_CACHE[key] = rope
    return rope
