"""Speculative decoding: draft proposers (n-gram prompt lookup, a draft model), the rejection sampler that
verifies drafts in one target forward pass, and the acceptance statistics. See docs/speculative_decoding.md."""

from tokenmill.spec_decode.config import SPEC_METHODS, SpeculativeConfig

__all__ = ["SPEC_METHODS", "SpeculativeConfig"]
