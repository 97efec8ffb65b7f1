"""The server's OpenAPI document (``GET /openapi.json``).

The handlers read and validate their bodies themselves (to control the error objects), so FastAPI cannot see
the request models; the routes name them with :func:`json_body` and :func:`install_openapi` adds their JSON
schemas to ``components.schemas``. Clients, docs and the fuzz tests (schemathesis) use this document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from tokenmill.entrypoints.openai.protocol import ErrorResponse

_REF = "#/components/schemas/{model}"

# Error statuses every JSON route may answer with (the OpenAI error object).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "Invalid request (the error's `param` names the field)"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (415, "Body is not JSON"),
        (500, "Engine failure"),
    )
}


def json_body(*models: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is one of ``models``."""
    refs = [{"$ref": _REF.format(model=m.__name__)} for m in models]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI, request_models: list[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` include the JSON schemas of ``request_models`` (and what they reference)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in request_models], ref_template=_REF)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
