"""Inputs on which the conformance kit compares a platform's state-layer ops (custom ops ``causal_conv1d``,
``mamba_ssd``, ``rms_norm_gated``, ``gated_delta_rule``, ``selective_scan``) with the portable versions: each case names the method
(``forward`` or ``update``) whose result must match the built-in's ``*_native`` method."""

from __future__ import annotations

import torch

STATE_OPS = ("causal_conv1d", "mamba_ssd", "rms_norm_gated", "gated_delta_rule", "selective_scan")


def state_op_cases(name: str, cls: type, dtype: torch.dtype, device: torch.device
                   ) -> list[tuple[object, str, tuple]]:
    """``(layer, method, args)`` cases for op ``name`` built with the replacement class ``cls``.

    Raises:
        KeyError: ``name`` is not one of :data:`STATE_OPS`.
    """
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    L, D, K, H, P, G, N, B = 19, 24, 4, 4, 6, 2, 8, 3
    with torch.device(device):
        if name == "causal_conv1d":
            op, w, b = cls(), rnd(D, K, scale=0.5), rnd(D, scale=0.1)
            return [(op, "forward", (rnd(L, D), w, b, None, "silu")),
                    (op, "forward", (rnd(L, D), w, b, rnd(D, K - 1), "silu")),
                    (op, "update", (rnd(B, D), rnd(B, D, K - 1), w, b, "silu"))]
        if name == "mamba_ssd":
            op = cls()
            A = -(torch.rand(H, generator=g) + 0.2).to(device)
            D_, bias = rnd(H), rnd(H, scale=0.3)
            return [(op, "forward", (rnd(L, H, P), rnd(L, H, scale=0.5), A, rnd(L, G, N), rnd(L, G, N), 8, D_, bias,
                                     rnd(H, P, N, scale=0.5).float())),
                    (op, "update", (rnd(B, H, P, N, scale=0.5).float(), rnd(B, H, P), rnd(B, H, scale=0.5), A,
                                    rnd(B, G, N), rnd(B, G, N), D_, bias))]
        if name == "rms_norm_gated":
            cases = []
            for before in (False, True):
                layer = cls(D, 1e-6, group_size=D // 2, norm_before_gate=before).to(dtype)
                layer.weight.data.copy_(rnd(D))
                cases.append((layer, "forward", (rnd(L, D), rnd(L, D))))
            return cases
        if name == "gated_delta_rule":
            op, dk, dv = cls(), 8, 6
            return [(op, "forward", (rnd(L, H, dk), rnd(L, H, dk), rnd(L, H, dv), -torch.rand(L, H, generator=g).to(device),
                                     torch.rand(L, H, generator=g).to(device), rnd(H, dk, dv, scale=0.3).float())),
                    (op, "update", (rnd(B, H, dk, dv, scale=0.3).float(), rnd(B, H, dk), rnd(B, H, dk), rnd(B, H, dv),
                                    -torch.rand(B, H, generator=g).to(device), torch.rand(B, H, generator=g).to(device)))]
        if name == "selective_scan":
            op = cls()
            A = -(torch.rand(D, N, generator=g) + 0.2).to(device)
            D_, bias = rnd(D), rnd(D, scale=0.3)
            return [(op, "forward", (rnd(L, D), rnd(L, D, scale=0.5), A, rnd(L, N), rnd(L, N), D_, rnd(L, D), bias,
                                     rnd(D, N, scale=0.5).float())),
                    (op, "update", (rnd(B, D, N, scale=0.5).float(), rnd(B, D), rnd(B, D, scale=0.5), A, rnd(B, N),
                                    rnd(B, N), D_, rnd(B, D), bias))]
    raise KeyError(name)
