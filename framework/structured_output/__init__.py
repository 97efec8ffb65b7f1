"""Structured outputs: constraining generation to a JSON schema, regex, choice or grammar.

The engine core's :class:`StructuredOutputManager` compiles constraints (xgrammar by default, llguidance as
the second backend, both behind :class:`StructuredOutputBackend`) and the scheduler sends each step's token
bitmask to the worker, which masks the logits before sampling. See docs/structured_outputs.md.
"""

from __future__ import annotations

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend_types import (
    GrammarSpecError,
    StructuredOutputBackend,
    StructuredOutputGrammar,
)
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.structured_output.request import StructuredOutputRequest
from tokenmill.structured_output.validation import BACKEND_CHOICES, resolve_structured_outputs

__all__ = [
    "BACKEND_CHOICES",
    "GrammarSpecError",
    "StructuredOutputBackend",
    "StructuredOutputGrammar",
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "StructuredOutputsParams",
    "resolve_structured_outputs",
]
