"""Request fields -> :class:`~tokenmill.sampling_params.StructuredOutputsParams`, checked before generation.

Entry points (also for other API front ends, e.g. a Responses API):

* :func:`json_schema_to_structured_outputs` -- a JSON schema (and OpenAI's ``strict``) as a constraint;
* :func:`response_format_to_structured_outputs` -- OpenAI's ``response_format`` object;
* :func:`structured_outputs_from_field` -- vLLM's ``structured_outputs`` request object;
* :func:`check_structured_outputs` -- compile-check a constraint with the server's backend, naming the
  request field in errors (an invalid schema, regex or grammar is a 400 before anything is queued).

Sources a request may use (at most one): ``response_format`` (json_object / json_schema / structural_tag),
``structured_outputs``, vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
and ``tool_choice`` ``required`` or a named function (see :mod:`tokenmill.entrypoints.openai.tool_choice`).
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.entrypoints.openai.protocol_tools import StructuredOutputsField
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParamsError, StructuredOutputsParams


def json_schema_to_structured_outputs(schema: dict[str, Any] | str, *, strict: bool | None = None,
                                      param: str = "response_format") -> StructuredOutputsParams:
    """A constraint to JSON valid against ``schema``.

    ``strict=True`` (OpenAI's strict mode) also closes every object to properties beyond its ``properties``
    (xgrammar does so always; llguidance only then).

    Raises:
        InvalidRequestError: ``schema`` is not a JSON object (or its text); ``param`` is set.
    """
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{param}: the JSON schema is not valid JSON: {exc}", param=param) from exc
    else:
        parsed = schema
    if not isinstance(parsed, dict):
        raise InvalidRequestError(f"{param}: the JSON schema must be an object, got {type(parsed).__name__}",
                                  param=param)
    return _params(param, json=parsed, disable_additional_properties=strict is True)


def response_format_to_structured_outputs(response_format: dict[str, Any] | None,
                                          param: str = "response_format") -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``; vLLM's ``structural_tag``).

    Returns ``None`` for ``text`` (no constraint).

    Raises:
        InvalidRequestError: unknown type, missing ``json_schema.schema``, wrong types; ``param`` names the
            field (``response_format``, ``response_format.json_schema``, ...).
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise InvalidRequestError(f"{param}: must be an object", param=param)
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _params(param, json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        where = f"{param}.json_schema"
        if not isinstance(spec, dict):
            raise InvalidRequestError(f"{where}: required with type 'json_schema' (an object with 'name' and "
                                      "'schema')", param=where)
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise InvalidRequestError(f"{where}.schema: the JSON schema is required", param=f"{where}.schema")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError(f"{where}.strict: must be a boolean", param=f"{where}.strict")
        return json_schema_to_structured_outputs(schema, strict=strict, param=f"{where}.schema")
    if kind == "structural_tag":
        return _params(param, structural_tag=json.dumps(response_format, ensure_ascii=False))
    raise InvalidRequestError(
        f"{param}: type {kind!r} is not supported (text, json_object, json_schema, structural_tag)", param=param
    )


def structured_outputs_from_field(field: StructuredOutputsField,
                                  param: str = "structured_outputs") -> StructuredOutputsParams:
    """vLLM's ``structured_outputs`` request object as engine parameters.

    Raises:
        InvalidRequestError: not exactly one constraint, or ``whitespace_pattern`` (not supported).
    """
    if field.whitespace_pattern is not None:
        raise InvalidRequestError(f"{param}.whitespace_pattern: not supported by this server (use "
                                  "disable_any_whitespace)", param=f"{param}.whitespace_pattern")
    tag = field.structural_tag
    return _params(
        param,
        json=field.json_,
        regex=field.regex,
        choice=field.choice,
        grammar=field.grammar,
        json_object=field.json_object or None,
        structural_tag=json.dumps(tag, ensure_ascii=False) if isinstance(tag, dict) else tag,
        disable_any_whitespace=field.disable_any_whitespace,
        disable_additional_properties=field.disable_additional_properties,
        backend="xgrammar" if field.disable_fallback else None,
    )


def check_structured_outputs(params: StructuredOutputsParams, backend: str, param: str) -> StructuredOutputsParams:
    """Compile-check ``params`` with ``backend`` (``auto`` resolved); errors name ``param``.

    Raises:
        InvalidRequestError: invalid constraint, or one the backend cannot compile.
    """
    from tokenmill.structured_output.validation import resolve_structured_outputs

    return resolve_structured_outputs(params, backend, param)


def _params(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except SamplingParamsError as exc:
        raise InvalidRequestError(f"{param}: {str(exc).split(': ', 1)[-1]}", param=param) from exc
