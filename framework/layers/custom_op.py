"""Custom ops: the layers a vendor or researcher may replace without editing model code.

A layer class that derives from :class:`CustomOp` and names an :attr:`CustomOp.op_name` is constructed through
the op registry: ``RMSNorm(hidden, eps)`` in model code builds the registered replacement (a subclass of
``RMSNorm``) when one is registered, so every model picks it up, ``isinstance`` checks and weight loading keep
working, and the replacement may fall back to the portable implementation, :meth:`CustomOp.forward_native`.
This is vLLM's ``CustomOp.register_oot`` idea; tokenmill feeds it from plugins and platforms.

Where a replacement comes from, first match wins (so a user's choice beats a plugin's, which beats the
platform's, which beats the built-in):

1. ``CustomOpRegistry.register_op(name, cls)`` called from the user's script (this process only);
2. the hook ``tokenmill_register_custom_ops(registry)`` of any loaded plugin (every process);
3. the current platform's ``Platform.get_custom_op_cls(name)`` (``"module:Class"`` or ``None``);
4. the built-in class.

Op names (:data:`CUSTOM_OPS`) and the base class a replacement must subclass:

============================  ==================================================  =============================
op name                       base class                                          replaces
============================  ==================================================  =============================
``rms_norm``                  :class:`tokenmill.layers.RMSNorm`                   every (non-sharded) RMSNorm
``rotary_embedding``          :class:`tokenmill.layers.RotaryEmbedding`           RoPE of every attention layer
``silu_and_mul``              :class:`tokenmill.layers.SiluAndMul`                SwiGLU activation
``gelu_and_mul``              :class:`tokenmill.layers.GeluAndMul`                GeGLU activation
``fused_moe``                 :class:`tokenmill.layers.FusedMoEMethod`            the experts of MoE layers
``quant_linear.int8``         :class:`tokenmill.layers.QuantizedWeight`           ``--quantization int8`` kernel
``quant_linear.int4``         :class:`tokenmill.layers.QuantizedWeight`           ``--quantization int4`` kernel
``unquantized_linear``        :class:`UnquantizedLinearMethod` (plugin API)       full-precision linear layers
``causal_conv1d``             :class:`tokenmill.layers.mamba.CausalConv1d`        state layers' causal conv1d
``mamba_ssd``                 :class:`tokenmill.layers.mamba.MambaSSD`            Mamba2 scan and recurrence
``rms_norm_gated``            :class:`tokenmill.layers.mamba.RMSNormGated`        Mamba2's gated output norm
``gated_delta_rule``          :class:`tokenmill.layers.mamba.GatedDeltaRule`      gated DeltaNet recurrence
``selective_scan``            :class:`tokenmill.layers.mamba.SelectiveScan`       Mamba-1 scan and recurrence
============================  ==================================================  =============================

``quant_linear.*``, ``fused_moe`` and ``unquantized_linear`` are not modules built by model code but the kernel classes the layers call; they resolve
through the same four steps (the platform's step is ``get_fused_moe_cls`` / ``get_quant_method_cls`` /
``get_custom_op_cls``). ``unquantized_linear`` is chosen once per model load
(:mod:`tokenmill.layers.linear_method`).
The conformance kit (``tokenmill plugins check``) compares every replacement a platform declares with the
portable implementation.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from torch import nn

from tokenmill.plugins.fed_registry import HookFedRegistry, Target

logger = logging.getLogger(__name__)

# op name -> "module:Class" of the base class a replacement must subclass (the built-in implementation)
CUSTOM_OPS: dict[str, str] = {
    "rms_norm": "tokenmill.layers.layernorm:RMSNorm",
    "rotary_embedding": "tokenmill.layers.rotary:RotaryEmbedding",
    "silu_and_mul": "tokenmill.layers.activation:SiluAndMul",
    "gelu_and_mul": "tokenmill.layers.activation:GeluAndMul",
    "fused_moe": "tokenmill.layers.fused_moe:FusedMoEMethod",
    "quant_linear.int8": "tokenmill.layers.quantization:QuantizedWeight",
    "quant_linear.int4": "tokenmill.layers.quantization:QuantizedWeight",
    "unquantized_linear": "tokenmill.layers.linear_method:UnquantizedLinearMethod",
    "causal_conv1d": "tokenmill.layers.mamba.state_ops:CausalConv1d",
    "mamba_ssd": "tokenmill.layers.mamba.state_ops:MambaSSD",
    "rms_norm_gated": "tokenmill.layers.mamba.state_ops:RMSNormGated",
    "gated_delta_rule": "tokenmill.layers.mamba.state_ops:GatedDeltaRule",
    "selective_scan": "tokenmill.layers.mamba.state_ops:SelectiveScan",
}


class UnknownCustomOpError(ValueError):
    """A custom-op name that tokenmill does not define."""


class CustomOpRegistry(HookFedRegistry):
    """Class-level map op name -> replacement class (``"module:Class"`` or a class), fed by the plugin hook
    ``tokenmill_register_custom_ops(registry)`` and by script calls."""

    hook_name: ClassVar[str] = "tokenmill_register_custom_ops"
    kind: ClassVar[str] = "custom op"

    @classmethod
    def register_op(cls, name: str, op_cls: Target) -> None:
        """Use ``op_cls`` wherever tokenmill builds op ``name`` (one of :data:`CUSTOM_OPS`).

        Raises:
            UnknownCustomOpError: ``name`` is not a custom op tokenmill defines (the message lists them).
            TypeError / ValueError: as :meth:`HookFedRegistry._register`.
        """
        if name not in CUSTOM_OPS:
            raise UnknownCustomOpError(f"unknown custom op {name!r}; tokenmill's custom ops: {', '.join(CUSTOM_OPS)}")
        cls._register(name, op_cls)

    @classmethod
    def get_registered_ops(cls) -> dict[str, str]:
        """Op name -> ``"module:Class"`` of every replacement registered by a script or plugin."""
        out: dict[str, str] = {}
        for name in cls._names():
            target = cls._lookup(name)
            if target is not None:
                out[name] = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
        return out

    @classmethod
    def lookup(cls, name: str) -> Target | None:
        """The script's or a plugin's replacement for ``name``, or ``None``."""
        return cls._lookup(name)


def resolve_custom_op(name: str, default: type) -> tuple[type, str]:
    """The class to build for op ``name`` and where it came from (``"builtin"``, ``"platform <name>"``,
    ``"plugin <entry point>"`` or ``"script"``).

    Args:
        name: one of :data:`CUSTOM_OPS`.
        default: the built-in class (also the class every replacement must subclass).

    Raises:
        TypeError: the replacement is not a subclass of ``default`` (the message names the op and its source).
        ImportError: the replacement's module cannot be imported.
    """
    target = CustomOpRegistry.lookup(name)
    source = CustomOpRegistry.source_of(name) if target is not None else ""
    if target is None:
        from tokenmill.platforms import get_current_platform

        platform = get_current_platform()
        path = platform.get_custom_op_cls(name)
        if path is None:
            return default, "builtin"
        target, source = path, f"platform {platform.name}"
    cls = CustomOpRegistry._load(name, target)
    if not issubclass(cls, default):
        raise TypeError(
            f"custom op {name!r} from {source}: {cls.__module__}.{cls.__qualname__} must subclass "
            f"{default.__module__}.{default.__qualname__}"
        )
    return cls, source


class CustomOp(nn.Module):
    """Base of the replaceable layers (see the module docstring).

    A subclass sets :attr:`op_name` and implements :meth:`forward_native`, the portable torch implementation
    (the reference a replacement is checked against). ``forward`` calls it; a replacement overrides ``forward``
    (and may call ``self.forward_native`` for inputs its kernel does not cover).

    Attributes:
        op_name: the op's name in :data:`CUSTOM_OPS`, set on the built-in class only (a replacement inherits
            it and is therefore never replaced again).
    """

    op_name: ClassVar[str] = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> CustomOp:
        impl = cls
        if "op_name" in cls.__dict__ and cls.op_name:  # constructing the built-in class: use the replacement
            impl, source = resolve_custom_op(cls.op_name, cls)
            if impl is not cls:
                logger.debug("custom op %s: %s (%s)", cls.op_name, impl.__qualname__, source)
        return super().__new__(impl)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__qualname__} does not implement forward_native")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)
