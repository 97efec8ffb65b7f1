"""The conformance kit's custom-op item on the state-layer ops: a platform's replacement of ``mamba_ssd``,
``causal_conv1d``, ``rms_norm_gated`` or ``gated_delta_rule`` must match the portable methods (``forward`` and
``update``); a wrong one fails naming the op and method."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenmill.conformance.checks_ops import check_custom_ops
from tokenmill.conformance.target import ContractFailure
from tokenmill.layers.mamba import CausalConv1d, GatedDeltaRule, MambaSSD, RMSNormGated


class ChunkedSSD(MambaSSD):
    """A different chunk length (same maths): must pass."""

    def forward(self, x, dt, A, B, C, chunk_size, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        return self.forward_native(x, dt, A, B, C, 3, *args, **kwargs)


class ConvWithoutState(CausalConv1d):
    """Ignores the carried conv state in decode: must fail."""

    def update(self, x, conv_state, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        return self.update_native(x, torch.zeros_like(conv_state), *args, **kwargs)


class SameNorm(RMSNormGated):
    pass


class SameDelta(GatedDeltaRule):
    pass


def target(ops: dict[str, str]) -> SimpleNamespace:
    notes: list[str] = []
    run_cls = SimpleNamespace(supported_dtypes=("float32",), default_dtype="float32",
                              get_custom_op_cls=ops.get,
                              get_fused_moe_cls=lambda: "tokenmill.layers.fused_moe:TorchFusedMoEMethod")
    ready = SimpleNamespace(backend_cls=SimpleNamespace(wait_until_ready=lambda: None))
    return SimpleNamespace(run_cls=run_cls, device=torch.device("cpu"), note=notes.append, notes=notes,
                           backend_choice=lambda: ready)


def test_matching_state_op_replacements_pass():
    t = target({"mamba_ssd": f"{__name__}:ChunkedSSD", "rms_norm_gated": f"{__name__}:SameNorm",
                "gated_delta_rule": f"{__name__}:SameDelta"})
    check_custom_ops(t)
    assert [n.split(":")[0] for n in t.notes] == ["mamba_ssd", "rms_norm_gated", "gated_delta_rule"]


def test_a_state_op_that_drops_the_state_fails_naming_the_method():
    with pytest.raises(ContractFailure, match=r"causal_conv1d\.update"):
        check_custom_ops(target({"causal_conv1d": f"{__name__}:ConvWithoutState"}))
