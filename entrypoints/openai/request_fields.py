"""Which request fields the server accepts, ignores on purpose, or refuses.

A JSON body is checked against its request model before validation (:func:`check_request_fields`):

* a field the model declares is validated and used;
* a field listed in the model's ``ignored_fields`` is accepted and dropped: ignoring it never changes what
  the model generates (``user``, ``metadata``, caching and billing hints, ...);
* a field listed in ``refused_fields`` is a 400 naming it, unless its value is one that asks for nothing
  (e.g. ``"use_beam_search": false``);
* any other field is a 400 naming it (the OpenAI API refuses unrecognized arguments the same way; vLLM
  logs and ignores them, which can silently change the meaning of a request, e.g. a misspelt
  constraint field served unconstrained).

A ``null`` value always means "not given" and is accepted for any field. All offending fields of a body are
named in one error; ``param`` is the first of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import InvalidRequestError


@dataclass(frozen=True)
class Refused:
    """A known field the server does not implement.

    Attributes:
        reason: why, or what to use instead (shown to the client).
        no_op: values that ask for nothing and are therefore accepted (e.g. ``False``, ``[]``).
    """

    reason: str
    no_op: tuple[Any, ...] = ()


@dataclass(frozen=True)
class FieldPolicy:
    """``ignored``: field -> why ignoring it is harmless (for the docs); ``refused``: field -> :class:`Refused`."""

    ignored: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, Refused] = field(default_factory=dict)

    def merged(self, other: FieldPolicy) -> FieldPolicy:
        return FieldPolicy({**self.ignored, **other.ignored}, {**self.refused, **other.refused})


def _is_no_op(value: Any, no_op: tuple[Any, ...]) -> bool:
    # ``True == 1`` in Python; compare types too so that ``1`` is not taken for ``True``.
    return any(type(value) is type(v) and value == v for v in no_op)


def declared_fields(model: Any) -> set[str]:
    """Names (and aliases) of the fields a pydantic model declares."""
    names: set[str] = set()
    for name, info in model.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return names


def check_request_fields(model: Any, data: dict[str, Any], policy: FieldPolicy | None = None) -> dict[str, Any]:
    """``data`` without the fields the policy ignores (and undeclared ``null`` ones).

    Args:
        model: the pydantic request model; its declared fields are always accepted.
        data: the request body (a JSON object).
        policy: the model's field policy (default: ``model.field_policy``).

    Raises:
        InvalidRequestError: refused or unrecognized fields (all named; ``param`` is the first).
    """
    policy = policy if policy is not None else getattr(model, "field_policy", FieldPolicy())
    declared = declared_fields(model)
    kept: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for key, value in data.items():
        if key in declared:
            kept[key] = value
        elif value is None or key in policy.ignored:
            continue
        elif key in policy.refused:
            refused = policy.refused[key]
            if not _is_no_op(value, refused.no_op):
                problems.append((key, refused.reason))
        else:
            problems.append((key, "unrecognized request argument"))
    if problems:
        raise InvalidRequestError("; ".join(f"{key}: {reason}" for key, reason in problems), param=problems[0][0])
    return kept
