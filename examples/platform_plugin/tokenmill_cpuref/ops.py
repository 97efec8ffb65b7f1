"""The platform's replacement of tokenmill's ``rms_norm`` custom op.

Every ``RMSNorm(...)`` that model code builds on this platform is a :class:`FunctionalRMSNorm` (tokenmill
constructs the registered replacement), so no model file changes. The conformance kit checks it against the
built-in ``forward_native``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.plugin_api import RMSNorm


class FunctionalRMSNorm(RMSNorm):
    """``torch.nn.functional.rms_norm`` in float32, with the built-in's weight offset, dtype rules and fused
    residual add (``forward(x)`` or ``forward(x, residual) -> (normed, x + residual)``)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):  # noqa: ANN201 - as RMSNorm
        if residual is not None:
            x = x + residual
        dtype = x.dtype
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.multiply_in_float32:
            out = (h * (self.weight.float() + self.offset)).to(dtype)
        else:
            out = (self.weight + self.offset if self.offset else self.weight) * h.to(dtype)
        return out if residual is None else (out, x)
