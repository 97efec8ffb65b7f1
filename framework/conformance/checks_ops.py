"""Contract items about the kernels a platform replaces: custom ops, fused MoE and quantized matmuls."""

from __future__ import annotations

import torch

from tokenmill.conformance.state_op_cases import STATE_OPS, state_op_cases
from tokenmill.conformance.target import ConformanceTarget, ContractFailure, ItemSkipped

LAYER_OPS = ("rms_norm", "rotary_embedding", "silu_and_mul", "gelu_and_mul")


def _dtype(t: ConformanceTarget) -> torch.dtype:
    return torch.float32 if "float32" in t.run_cls.supported_dtypes else getattr(torch, t.run_cls.default_dtype)


def _tol(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def _close(name: str, got: object, want: object, tol: float) -> float:
    gots = got if isinstance(got, tuple) else (got,)
    wants = want if isinstance(want, tuple) else (want,)
    if len(gots) != len(wants):
        raise ContractFailure(f"custom op {name}: returned {len(gots)} tensors, the built-in returns {len(wants)}")
    worst = 0.0
    for a, b in zip(gots, wants):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ContractFailure(f"custom op {name}: returned {tuple(a.shape)} {a.dtype}, the built-in "
                                  f"{tuple(b.shape)} {b.dtype}")
        err = float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-6))
        worst = max(worst, err)
    if not worst <= tol:
        raise ContractFailure(f"custom op {name}: differs from the built-in forward_native by {worst:.3g} "
                              f"(relative), more than {tol:g}")
    return worst


def _layer_cases(name: str, cls: type, dtype: torch.dtype, device: torch.device) -> list[tuple[object, tuple]]:
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    with torch.device(device):
        if name == "rms_norm":
            cases = []
            for kwargs in ({}, {"offset": 1.0, "multiply_in_float32": True}):
                layer = cls(64, 1e-6, **kwargs).to(dtype)
                layer.weight.data.copy_(rnd(64))
                cases += [(layer, (rnd(5, 64),)), (layer, (rnd(5, 64), rnd(5, 64)))]
            return cases
        if name == "rotary_embedding":
            layer = cls(32, 32, 256, 10000.0, None)
            positions = torch.tensor([0, 3, 17, 200, 5], device=device)
            return [(layer, (positions, rnd(5, 4 * 32), rnd(5, 2 * 32)))]
        if name == "gelu_and_mul":
            return [(cls("tanh"), (rnd(5, 128),)), (cls("none"), (rnd(5, 128),))]
        return [(cls(), (rnd(5, 128),))]


def check_custom_ops(t: ConformanceTarget) -> None:
    """Every layer the platform replaces (``get_custom_op_cls``) subclasses the built-in and its ``forward``
    matches the built-in's ``forward_native`` on the same inputs; a platform ``unquantized_linear`` method
    matches ``F.linear``; a platform fused-MoE method matches the portable one."""
    from tokenmill.layers.custom_op import CUSTOM_OPS
    from tokenmill.plugins.qualname import resolve_qualname

    dtype, replaced = _dtype(t), []
    for name in LAYER_OPS + STATE_OPS:
        path = t.run_cls.get_custom_op_cls(name)
        if path is None:
            continue
        base = resolve_qualname(CUSTOM_OPS[name])
        cls = resolve_qualname(path)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ContractFailure(f"custom op {name}: {path} must subclass {CUSTOM_OPS[name]}")
        if name in STATE_OPS:  # a forward and an update method, each against its *_native
            _wait_for_background_kernels(t)
            cases = state_op_cases(name, cls, dtype, t.device)
        else:
            cases = [(layer, "forward", args) for layer, args in _layer_cases(name, cls, dtype, t.device)]
        with torch.inference_mode():
            worst = 0.0
            for layer, method, args in cases:
                if type(layer) is not cls:
                    raise ContractFailure(f"custom op {name}: building the layer gave {type(layer).__qualname__}, "
                                          f"not {cls.__qualname__}")
                want = getattr(base, f"{method}_native")(layer, *args)
                worst = max(worst, _close(f"{name}.{method}", getattr(layer, method)(*args), want, _tol(dtype)))
        replaced.append(name)
        t.note(f"{name}: {path} within {worst:.1e} of the built-in")
    linear = t.run_cls.get_custom_op_cls("unquantized_linear")
    if linear is not None:
        _check_unquantized_linear(t, linear, dtype)
        replaced.append("unquantized_linear")
    moe = t.run_cls.get_fused_moe_cls()
    if moe and moe != "tokenmill.layers.fused_moe:TorchFusedMoEMethod":
        _check_fused_moe(t, moe, dtype)
        replaced.append("fused_moe")
    if not replaced:
        raise ItemSkipped("the platform replaces no custom op (get_custom_op_cls returns None, default fused MoE)")


def _wait_for_background_kernels(t: ConformanceTarget) -> None:
    """Kernels a platform builds in the background are waited for through its attention backend (as the engine's
    compiled runner does), so that the checks run on them rather than on a fallback."""
    t.backend_choice().backend_cls.wait_until_ready()


def _check_unquantized_linear(t: ConformanceTarget, path: str, dtype: torch.dtype) -> None:
    """The method's ``apply`` (and ``apply_with_bias``) matches ``F.linear`` at several row counts, before and after
    ``process_weights_after_loading``, which leaves the layer's weight in place and unchanged. The platform's
    attention backend is waited for first (``wait_until_ready``: kernels built in the background)."""
    from tokenmill.layers.linear import ReplicatedLinear
    from tokenmill.layers.linear_method import UnquantizedLinearMethod
    from tokenmill.plugins.qualname import resolve_qualname

    cls = resolve_qualname(path)
    if not (isinstance(cls, type) and issubclass(cls, UnquantizedLinearMethod)):
        raise ContractFailure(f"unquantized_linear: {path} is not an UnquantizedLinearMethod subclass")
    _wait_for_background_kernels(t)
    g = torch.Generator().manual_seed(3)
    layer = ReplicatedLinear(96, 80, bias=False).to(dtype).to(t.device)
    weight = (torch.randn(80, 96, generator=g) * 0.1).to(dtype).to(t.device)
    layer.weight.data.copy_(weight)
    bias = torch.randn(80, generator=g).to(dtype).to(t.device)
    method = cls()
    worst = 0.0
    with torch.inference_mode():
        for processed in (False, True):
            if processed:
                added = method.process_weights_after_loading(layer)
                if not isinstance(added, int) or added < 0:
                    raise ContractFailure(f"unquantized_linear: process_weights_after_loading returned {added!r}, "
                                          "not the bytes it added")
                if not torch.equal(layer.weight, weight):
                    raise ContractFailure("unquantized_linear: process_weights_after_loading changed layer.weight")
            for rows in (1, 3, 8, 33):
                x = torch.randn(rows, 96, generator=g).to(dtype).to(t.device)
                got = method.apply(layer, x)
                worst = max(worst, _close("unquantized_linear", got, torch.nn.functional.linear(x, weight),
                                          _tol(dtype)))
                got = method.apply_with_bias(layer, x, bias)
                worst = max(worst, _close("unquantized_linear (with bias)", got,
                                          torch.nn.functional.linear(x, weight, bias), _tol(dtype)))
    t.note(f"unquantized_linear: {path} within {worst:.1e} of F.linear")


def _check_fused_moe(t: ConformanceTarget, path: str, dtype: torch.dtype) -> None:
    from tokenmill.layers.fused_moe import FusedMoEMethod, TorchFusedMoEMethod
    from tokenmill.plugins.qualname import resolve_qualname

    cls = resolve_qualname(path)
    if not (isinstance(cls, type) and issubclass(cls, FusedMoEMethod)):
        raise ContractFailure(f"fused_moe: {path} is not a FusedMoEMethod subclass")
    g = torch.Generator().manual_seed(1)
    tokens, hidden, inter, experts, top_k = 9, 64, 32, 4, 2

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.2).to(dtype).to(t.device)

    x, w13, w2 = rnd(tokens, hidden), rnd(experts, 2 * inter, hidden), rnd(experts, hidden, inter)
    weights, ids = torch.softmax(torch.randn(tokens, experts, generator=g), -1).topk(top_k, dim=-1)
    weights, ids = weights.to(t.device), ids.to(t.device)
    with torch.inference_mode():
        got = cls().apply(x, w13, w2, weights, ids, "silu")
        want = TorchFusedMoEMethod().apply(x, w13, w2, weights, ids, "silu")
    worst = _close("fused_moe", got, want, _tol(dtype))
    t.note(f"fused_moe: {path} within {worst:.1e} of TorchFusedMoEMethod")


_QUANT_LIMITS = {"int8": 0.02, "int4": 0.2}  # relative Frobenius error of x @ W^T on Gaussian data


def check_quantization(t: ConformanceTarget) -> None:
    """Every ``--quantization`` method the platform offers gives a QuantizedWeight whose ``matmul`` is close to
    the full-precision product and whose ``nbytes`` is smaller than the full-precision weight."""
    from tokenmill.config import QUANTIZATION_METHODS
    from tokenmill.layers.quantization import QuantizedWeight
    from tokenmill.plugins.qualname import resolve_qualname

    offered = []
    g = torch.Generator().manual_seed(2)
    w = torch.randn(128, 256, generator=g) * 0.05
    x = torch.randn(4, 256, generator=g)
    dtype = _dtype(t)
    for method in QUANTIZATION_METHODS:
        path = t.run_cls.get_quant_method_cls(method)
        if path is None:
            continue
        cls = resolve_qualname(path)
        if not (isinstance(cls, type) and issubclass(cls, QuantizedWeight)):
            raise ContractFailure(f"quantization {method}: {path} is not a QuantizedWeight subclass")
        with torch.inference_mode():
            q = cls(w.to(dtype).to(t.device)).to(t.device)
            got = q.matmul(x.to(dtype).to(t.device)).float().cpu()
        want = x @ w.T
        err = float((got - want).norm() / want.norm())
        full = w.numel() * w.element_size()
        t.note(f"{method}: {path}, relative error {err:.3f}, {q.nbytes} bytes vs {full} in float32")
        if got.shape != want.shape:
            raise ContractFailure(f"quantization {method}: matmul returned {tuple(got.shape)}, expected {tuple(want.shape)}")
        if not err <= _QUANT_LIMITS.get(method, 0.2):
            raise ContractFailure(f"quantization {method}: matmul is {err:.3f} off the full-precision product "
                                  f"(relative Frobenius error; limit {_QUANT_LIMITS.get(method, 0.2)})")
        if not 0 < q.nbytes < full:
            raise ContractFailure(f"quantization {method}: nbytes = {q.nbytes}, not below the float32 weight's {full}")
        offered.append(method)
    if not offered:
        raise ItemSkipped("the platform offers no --quantization method")
