"""The conformance kit: proves a platform plugin against tokenmill's references.

Run it as ``tokenmill plugins check NAME`` (exit status 0 only when every item passes), from Python with
:func:`run_conformance`, or in a vendor's own CI with the pytest plugin
(``pytest -p tokenmill.conformance.pytest_plugin --tokenmill-platform NAME``, one test per contract item).
The items (:func:`contract_items`) and what each checks are listed in ``docs/plugins.md``.
"""

from __future__ import annotations

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
