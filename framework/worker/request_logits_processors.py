"""Per-request logits processors: callables a request names by qualified name (vLLM's ``logits_processors``
request field and ``--logits-processor-pattern`` engine flag).

A request's :class:`~tokenmill.sampling_params.LogitsProcessorSpec` list names importable objects; each name must
match the engine's ``logits_processor_pattern`` (a regular expression matched against the whole name), so only
code the operator allows is ever imported. Without a pattern, a request that names any processor is refused.
A name given alone is the processor; with ``args`` / ``kwargs`` it is a factory called with them once per
request (so a processor may keep per-request state). A processor is called for each token the request samples
as ``fn(output_token_ids, logits)`` or ``fn(prompt_token_ids, output_token_ids, logits)`` (vLLM's two forms,
told apart by the number of positional parameters), where ``logits`` is the request's ``[vocab]`` row (the
model's dtype or float32) and the return value is the row to sample from.

These run after the engine-wide processors (plugins' and ``--logits-processors``) and before the grammar mask.
The engine front end builds every processor once when the request arrives (:func:`check_request_processors`),
so a name that is not allowed, cannot be imported or whose factory fails is a 400, not a worker failure.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import LogitsProcessorSpec

if TYPE_CHECKING:  # the front end validates processors with this module and starts without torch
    import torch

PARAM = "logits_processors"
RequestProcessor = Callable[..., "torch.Tensor"]


def resolve_name(qualname: str) -> Any:
    """Import ``"pkg.mod:Name"`` or ``"pkg.mod.Name"`` (the last dot separates module and name).

    Raises:
        ValueError: ``qualname`` has neither form.
        ImportError: the module or the name does not exist.
    """
    from tokenmill.plugins.qualname import resolve_qualname

    if ":" not in qualname:
        module, _, name = qualname.rpartition(".")
        qualname = f"{module}:{name}"
    return resolve_qualname(qualname)


def _build(spec: LogitsProcessorSpec, pattern: str | None) -> tuple[RequestProcessor, bool]:
    """The processor of ``spec`` and whether it takes the prompt ids.

    Raises:
        InvalidRequestError: not allowed, not importable, its factory failed, or it is not callable with two or
            three positional arguments.
    """
    name = spec.qualname
    if pattern is None:
        raise InvalidRequestError(f"{PARAM}: per-request logits processors are off; start the server with "
                                  "--logits-processor-pattern REGEX to allow the names it matches", param=PARAM)
    if not re.fullmatch(pattern, name):
        raise InvalidRequestError(f"{PARAM}: {name!r} is not allowed by this server (it does not match "
                                  "--logits-processor-pattern)", param=PARAM)
    try:
        target = resolve_name(name)
    except (ImportError, ValueError) as exc:
        raise InvalidRequestError(f"{PARAM}: {name!r} could not be imported: {exc}", param=PARAM) from exc
    if spec.args is not None or spec.kwargs is not None:
        try:
            target = target(*(spec.args or []), **(spec.kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - the factory is user code; any failure is the request's
            raise InvalidRequestError(f"{PARAM}: {name!r}(*args, **kwargs) failed: {exc}", param=PARAM) from exc
    try:
        params = [p for p in inspect.signature(target).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{PARAM}: {name!r} is not a callable processor", param=PARAM) from exc
    if len(params) not in (2, 3):
        raise InvalidRequestError(f"{PARAM}: {name!r} must take (output_token_ids, logits) or (prompt_token_ids, "
                                  f"output_token_ids, logits), it takes {len(params)} positional arguments",
                                  param=PARAM)
    return target, len(params) == 3


def check_request_processors(specs: Sequence[LogitsProcessorSpec] | None, pattern: str | None,
                             speculative: bool = False) -> None:
    """Build each processor once, as the worker will (see the module docstring).

    Raises:
        InvalidRequestError: ``param="logits_processors"``; also with speculative decoding, whose draft rows
            a per-request processor could not tell apart.
    """
    if not specs:
        return
    if speculative:
        raise InvalidRequestError(f"{PARAM}: per-request logits processors cannot run with speculative decoding",
                                  param=PARAM)
    for spec in specs:
        _build(spec, pattern)


class RequestProcessors:
    """The processors of one running request, built on its first sampled token."""

    def __init__(self, specs: Sequence[LogitsProcessorSpec], pattern: str | None) -> None:
        self.processors = [_build(spec, pattern) for spec in specs]

    def apply(self, logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        """``logits`` ``[vocab]`` after every processor in order.

        Raises:
            RuntimeError: a processor returned something other than a ``[vocab]`` tensor.
        """
        for fn, takes_prompt in self.processors:
            out = fn(prompt_ids, output_ids, logits) if takes_prompt else fn(output_ids, logits)
            if not isinstance(out, type(logits)) or out.shape != logits.shape:
                raise RuntimeError(f"logits processor {fn!r} returned "
                                   f"{getattr(out, 'shape', type(out).__name__)}, expected {tuple(logits.shape)}")
            logits = out
        return logits


def apply_request_processors(logits: torch.Tensor, states: Sequence[Any], pattern: str | None) -> torch.Tensor:
    """Run the per-request processors of the rows that have some.

    Args:
        logits: ``[N, vocab]``, row ``i`` being ``states[i]``'s.
        states: the rows' :class:`~tokenmill.worker.input_batch.CachedRequestState` (their processors are built
            and kept in ``state.request_processors``).
        pattern: the engine's ``logits_processor_pattern``.
    """
    for i, state in enumerate(states):
        specs = state.sampling_params.logits_processors
        if not specs:
            continue
        if state.request_processors is None:
            state.request_processors = RequestProcessors(specs, pattern)
        prompt = state.token_ids[: state.num_prompt_tokens]
        output = state.token_ids[state.num_prompt_tokens:]
        logits[i] = state.request_processors.apply(logits[i], prompt, output)
    return logits
