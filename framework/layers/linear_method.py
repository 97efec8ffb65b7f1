"""How full-precision linear layers multiply: the ``unquantized_linear`` custom op.

Every :class:`tokenmill.layers.LinearBase` (and the LM head) computes ``y = x W^T`` through one
:class:`UnquantizedLinearMethod` chosen per model: the built-in one calls ``F.linear``; a platform (or a plugin,
or a script, through :mod:`tokenmill.layers.custom_op`) may replace it with a subclass that re-lays out each
weight once after loading, as vLLM's ``UnquantizedLinearMethod.process_weights_after_loading`` does on CPUs.
The CPU plugin's method keeps a packed copy of each weight (MKL's for float32, oneDNN's for bfloat16), because
torch's CPU GEMM re-packs the weight on every call, which dominates the small matmuls of decode steps.

Contract of a replacement (checked by ``tokenmill plugins check``, item ``custom_ops``):

* :meth:`UnquantizedLinearMethod.process_weights_after_loading` runs once per layer after the checkpoint is
  loaded and quantized copies are attached, before the KV cache is sized (so memory it adds is accounted for);
  it returns the bytes it added. It must leave ``layer.weight`` in place: weights stay graph inputs of the
  compiled forward passes, tied weights and LoRA read them, and the compile worker traces the method without
  calling this.
* :meth:`UnquantizedLinearMethod.apply` returns what ``F.linear(x, layer.weight)`` returns (shape, dtype; values
  to rounding) for any number of rows, whether or not the weights were processed, and is traceable by
  ``torch.compile`` (an opaque custom op for anything device-specific).
* :meth:`UnquantizedLinearMethod.apply_with_bias` returns what ``F.linear(x, layer.weight, bias)`` returns, on
  the same terms. The built-in adds the bias inside the GEMM (``addmm``); for a replacement that does not
  override it, the bias is added to :meth:`~UnquantizedLinearMethod.apply`'s product (one more pass over the
  output, which an epilogue in the replacement's kernel saves).
* :meth:`UnquantizedLinearMethod.cache_key_facts` names whatever besides the class decides what ``apply`` traces
  (an environment switch, a row bound read at import): it joins the key of the compiled forward passes' on-disk
  cache, so that a graph traced under one setting is not loaded under another.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class UnquantizedLinearMethod:
    """The built-in method: ``F.linear`` on the layer's weight, nothing prepared (module docstring)."""

    def process_weights_after_loading(self, layer: nn.Module) -> int:
        """Prepare ``layer.weight`` (``[N, K]``) for :meth:`apply`; the bytes of device memory added (0 here)."""
        return 0

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x [T, K]`` -> ``x W^T`` ``[T, N]`` in the weight's dtype (no bias)."""
        return F.linear(x, layer.weight)

    def apply_with_bias(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``x [T, K]``, ``bias [N]`` -> ``x W^T + bias`` ``[T, N]`` in the weight's dtype (module docstring)."""
        if type(self).apply is UnquantizedLinearMethod.apply:
            return F.linear(x, layer.weight, bias)
        return self.apply(layer, x) + bias

    def cache_key_facts(self) -> dict[str, Any]:
        """JSON-serializable settings (besides this class and its package's source, which the cache key has
        already) that change the graphs :meth:`apply` traces; none by default."""
        return {}


DEFAULT_METHOD = UnquantizedLinearMethod()


def get_unquantized_linear_method() -> UnquantizedLinearMethod:
    """A new instance of the ``unquantized_linear`` class the script, a plugin or the platform chose (see
    :func:`tokenmill.layers.custom_op.resolve_custom_op`), or the built-in one.

    Raises:
        TypeError / ImportError: as :func:`tokenmill.layers.custom_op.resolve_custom_op`.
    """
    from tokenmill.layers.custom_op import resolve_custom_op

    cls, source = resolve_custom_op("unquantized_linear", UnquantizedLinearMethod)
    if cls is UnquantizedLinearMethod:
        return DEFAULT_METHOD
    logger.debug("unquantized linear method: %s (%s)", cls.__qualname__, source)
    return cls()


def attach_linear_method(model: nn.Module, process: bool = True) -> int:
    """Give every full-precision linear layer of ``model`` (modules with a ``linear_method`` attribute: linear
    layers and the LM head) the chosen method and, with ``process``, let it prepare each weight.

    ``process=False`` is for a process that only traces the model (the compile worker): the graphs then call
    the same method, and nothing is copied.

    Returns:
        bytes of memory the method added (0 without ``process``).
    """
    method = get_unquantized_linear_method()
    start = time.perf_counter()
    layers = added = 0
    for module in model.modules():
        if not hasattr(module, "linear_method") or getattr(module, "weight", None) is None:
            continue
        if getattr(module, "quant_only", False):  # no float weight: only its quantized one
            continue
        module.linear_method = method
        layers += 1
        if process:
            added += method.process_weights_after_loading(module)
    if method is not DEFAULT_METHOD:
        logger.info("linear layers: %s for %d layers (%.1f MiB of prepared weights in %.2f s)",
                    type(method).__qualname__, layers, added / 2**20, time.perf_counter() - start)
    return added
