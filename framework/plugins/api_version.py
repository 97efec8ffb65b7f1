"""The version of tokenmill's plugin API and the check of what a plugin requires.

``PLUGIN_API_VERSION`` is ``"MAJOR.MINOR"``: the minor number grows when names are added to
:mod:`tokenmill.plugin_api` (or hooks to the hook specs), the major number when something a plugin may use
changes or disappears. A plugin declares what it needs with a module-level constant in the module its entry
point names::

    TOKENMILL_PLUGIN_API = ">=1.0,<2"     # a PEP 440 version specifier

and tokenmill refuses to load a plugin whose requirement this version does not meet, naming the plugin.
"""

from __future__ import annotations

PLUGIN_API_VERSION = "1.8"  # 1.1: Platform.allocate_kv_cache, UnquantizedLinearMethod; 1.2: finish_kv_cache_allocation;
# 1.3: reasoning parsers (ReasoningParser, tokenmill_register_reasoning_parsers); 1.4: state layers and their ops
# (MambaBase, MambaMixer2, GatedDeltaNet, StateMetadata, CausalConv1d, MambaSSD, RMSNormGated, GatedDeltaRule);
# 1.5: quantized KV caches (AttentionBackend.supported_quantized_kv_cache_dtypes, quantize_kv, dequantize_kv,
# kv_cache_row_size, is_quantized_kv_dtype)
# 1.6: the Triton group-quantized weight formats (TritonGroupQuantWeight, TritonInt8Weight, TritonInt4Weight)
# 1.7: UnquantizedLinearMethod.apply_with_bias (the bias inside the product); TorchPagedAttentionImpl.forward_bidirectional
# (encoder-only steps of a subclassing backend)
# 1.8: Mamba-1 state layers (MambaMixer, SelectiveScan, custom op selective_scan); MambaBase.run_with_states;
# FusedMoE experts without a gate (gated=False) and FusedMoE.apply_routed
REQUIREMENT_ATTR = "TOKENMILL_PLUGIN_API"


def unmet_requirement(requirement: object, version: str = PLUGIN_API_VERSION) -> str | None:
    """Why ``requirement`` (a plugin's ``TOKENMILL_PLUGIN_API``) is not met by ``version``, or ``None`` if
    it is met.

    A bare version such as ``"1.2"`` means ``">=1.2,<2"`` (same major version, at least that minor one).
    """
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    if not isinstance(requirement, str) or not requirement.strip():
        return f"{REQUIREMENT_ATTR} must be a version specifier string such as '>=1.0,<2', got {requirement!r}"
    text = requirement.strip()
    try:
        if text[0].isdigit():
            base = Version(text)
            spec = SpecifierSet(f">={base},<{base.major + 1}")
        else:
            spec = SpecifierSet(text)
    except (InvalidSpecifier, InvalidVersion):
        return f"{REQUIREMENT_ATTR} = {requirement!r} is not a valid version specifier (e.g. '>=1.0,<2')"
    if Version(version) in spec:
        return None
    return f"it requires plugin API {text}, but this tokenmill provides plugin API {version}"
