"""Front-end checks of a structured-output constraint, before the request reaches the engine core.

:func:`resolve_structured_outputs` parses the constraint with the chosen backend (no tokenizer needed, a few
milliseconds at most; results are cached) so that an invalid schema, regex or grammar is an
:class:`~tokenmill.errors.InvalidRequestError` naming the field, and fills in
``StructuredOutputsParams.backend``. With ``auto`` the backend is chosen per request by what the constraint
needs: xgrammar when it can compile it, llguidance when xgrammar reports the feature as unsupported and
llguidance accepts it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import msgspec

from tokenmill.sampling_params import STRUCTURED_OUTPUT_BACKENDS, StructuredOutputsParams
from tokenmill.structured_output.backend_types import GrammarSpecError, StructuredOutputBackend, grammar_key

BACKEND_CHOICES = ("auto", *STRUCTURED_OUTPUT_BACKENDS)
_CACHE_SIZE = 512
_cache: OrderedDict[tuple[object, ...], str | GrammarSpecError] = OrderedDict()
_lock = threading.Lock()


def backend_class(name: str) -> type[StructuredOutputBackend]:
    """The backend class of ``name`` (``"xgrammar"`` or ``"guidance"``).

    Raises:
        ValueError: unknown name.
    """
    if name == "xgrammar":
        from tokenmill.structured_output.backend_xgrammar import XgrammarBackend

        return XgrammarBackend
    if name == "guidance":
        from tokenmill.structured_output.backend_guidance import GuidanceBackend

        return GuidanceBackend
    raise ValueError(f"structured_outputs_backend: must be one of {', '.join(BACKEND_CHOICES)}, got {name!r}")


def _choose(params: StructuredOutputsParams, configured: str, param: str) -> str:
    wanted = params.backend or configured
    if wanted != "auto":
        backend_class(wanted).validate(params, param)
        return wanted
    try:
        backend_class("xgrammar").validate(params, param)
        return "xgrammar"
    except GrammarSpecError as xgrammar_error:
        if not xgrammar_error.unsupported:
            raise
        try:
            backend_class("guidance").validate(params, param)
        except GrammarSpecError:
            raise xgrammar_error from None
        return "guidance"


def resolve_structured_outputs(params: StructuredOutputsParams, configured_backend: str = "auto",
                               param: str = "structured_outputs") -> StructuredOutputsParams:
    """Check ``params`` with its backend and return it with ``backend`` set.

    Args:
        params: the constraint (``params.backend``, when set, overrides ``configured_backend``).
        configured_backend: the engine's ``--structured-outputs-backend`` (``auto``, ``xgrammar``, ``guidance``).
        param: the request field errors name (``response_format``, ``tool_choice``, ...).

    Raises:
        InvalidRequestError (GrammarSpecError): invalid constraint, or one the backend cannot compile; the
            message says which and why, ``param`` is set.
        ValueError: ``configured_backend`` is not a known backend.
    """
    if configured_backend not in BACKEND_CHOICES:
        raise ValueError(
            f"structured_outputs_backend: must be one of {', '.join(BACKEND_CHOICES)}, got {configured_backend!r}"
        )
    params.validate(param)
    key = (params.backend or configured_backend, param, *grammar_key(params))
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
    if hit is None:
        try:
            hit = _choose(params, configured_backend, param)
        except GrammarSpecError as exc:
            hit = exc
        with _lock:
            _cache[key] = hit
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    if isinstance(hit, GrammarSpecError):
        raise GrammarSpecError(str(hit), hit.param or param, hit.unsupported)
    if params.backend == hit:
        return params
    return msgspec.structs.replace(params, backend=hit)
