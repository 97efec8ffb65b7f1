"""The conformance kit: proves a platform plugin against tokenmill's references.

Run it as ``tokenmill plugins check NAME`` (exit status 0 only when every item passes), from Python with
:func:`run_conformance`, or in a vendor's own CI with the pytest plugin
(``pytest -p tokenmill.conformance.pytest_plugin --tokenmill-platform NAME``, one test per contract item).
The items (:func:`contract_items`) and what each checks are listed in ``docs/plugins.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.conformance.kit import (
        CONTRACT_ITEMS,
        ConformanceReport,
        ItemResult,
        contract_items,
        resolve_target,
        run_conformance,
        run_item,
    )
    from tokenmill.conformance.target import ConformanceTarget, ContractFailure, ItemSkipped

# Imported on first use: the pytest plugin (tokenmill.conformance.pytest_plugin, loaded by every pytest run in an
# environment with tokenmill installed) lives in this package and must not import torch while it is inert.
_EXPORTS = {
    "CONTRACT_ITEMS": "kit", "ConformanceReport": "kit", "ItemResult": "kit", "contract_items": "kit",
    "resolve_target": "kit", "run_conformance": "kit", "run_item": "kit",
    "ConformanceTarget": "target", "ContractFailure": "target", "ItemSkipped": "target",
}

__all__ = [
    "CONTRACT_ITEMS",
    "ConformanceReport",
    "ConformanceTarget",
    "ContractFailure",
    "ItemResult",
    "ItemSkipped",
    "contract_items",
    "resolve_target",
    "run_conformance",
    "run_item",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"tokenmill.conformance.{_EXPORTS[name]}"), name)
