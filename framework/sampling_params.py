"""SamplingParams: how to pick each generated token and when to stop.

Field names, defaults and meaning follow vLLM's ``SamplingParams`` (see the vLLM docs, "Sampling Parameters")
so that users can move code between the two. Every invalid value raises ``ValueError`` whose message starts
with the field's name; the OpenAI server turns that into a 400 with ``param`` set to it.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import msgspec

from tokenmill.errors import InvalidRequestError

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20
# Temperatures below this are greedy (argmax), as in vLLM; the samplers also floor their divisor at it.
SAMPLING_EPS = 1e-5


class RequestOutputKind(IntEnum):
    """What ``generate`` yields while a request runs (vLLM's names)."""

    CUMULATIVE = 0  # every output holds all text/tokens so far
    DELTA = 1  # every output holds only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}", param=param)


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A constraint on the generated text, enforced by the engine while sampling (vLLM's names).

    Exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` and ``structural_tag`` is set.
    The engine compiles it into a grammar (see docs/structured_outputs.md) and masks, at every step, the
    tokens that would leave the language of the grammar; the request stops when the grammar is complete and
    EOS is sampled.

    Attributes:
        json: a JSON schema (an object, or its JSON text): the output is a JSON value valid against it.
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar: EBNF (GBNF, as llama.cpp and xgrammar write it) or Lark (llguidance).
        json_object: the output is any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
        structural_tag: a JSON text: xgrammar's structural tag (free text in which ``begin`` ... ``end``
            segments that start at a trigger follow a JSON schema), as vLLM accepts it.
        disable_any_whitespace: JSON without whitespace outside strings (compact output; fewer tokens).
        disable_additional_properties: a schema object without ``additionalProperties`` allows no keys other
            than its ``properties`` (instead of JSON Schema's default of allowing any).
        backend: the backend that compiles this constraint (``"xgrammar"`` or ``"guidance"``); ``None``: the
            engine's ``--structured-outputs-backend``. The front end fills it in when that is ``auto``.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    backend: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, param: str = "structured_outputs") -> None:
        """Check the shape (one constraint, right types); the grammar itself is checked by the backend.

        Raises:
            SamplingParamsError: ``param`` (default ``structured_outputs``) names the field.
        """
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            what = "none was given" if not given else f"got {', '.join(given)}"
            raise SamplingParamsError(param, f"exactly one of {', '.join(_CONSTRAINTS)} must be set; {what}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise SamplingParamsError(param, f"json must be a JSON schema object or its JSON text, got "
                                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(param, f"{name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise SamplingParamsError(param, "choice must be a non-empty list of strings")
            for c in self.choice:
                if not isinstance(c, str) or not c:
                    raise SamplingParamsError(param, f"choice entries must be non-empty strings, got {c!r}")
        if self.backend is not None and self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise SamplingParamsError(
                param, f"backend must be one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}, got {self.backend!r}"
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"``, ``"json_object"`` or
        ``"structural_tag"``."""
        for name in _CONSTRAINTS:
            if getattr(self, name) not in (None, False):
                return name
        raise SamplingParamsError("structured_outputs", "no constraint is set")


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# The concrete backends a request can name (the engine flag also takes "auto").
STRUCTURED_OUTPUT_BACKENDS = ("xgrammar", "guidance")


class ReasoningParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What the engine needs to know about a reasoning model's thinking (filled by the front end from its
    ``--reasoning-parser``; see docs/reasoning.md).

    The output is taken to start inside the thinking. Until the generated tokens contain ``end_token_ids`` the
    request's ``structured_outputs`` grammar is not enforced (the thinking is free text; the grammar applies to
    the answer), and when ``thinking_token_budget`` tokens have been generated without them, the engine emits
    ``end_token_ids`` itself, one per step, and the answer follows.

    Attributes:
        end_token_ids: the token ids of the end-of-thinking marker (e.g. ``</think>``), non-empty.
        thinking_token_budget: most tokens of thinking (vLLM's request field of that name); ``None``: no limit.
    """

    end_token_ids: list[int]
    thinking_token_budget: int | None = None

    def validate(self) -> None:
        """Raises:
        SamplingParamsError: ``end_token_ids`` empty or not token ids, or a negative budget.
        """
        if not isinstance(self.end_token_ids, list) or not self.end_token_ids:
            raise SamplingParamsError("reasoning", "end_token_ids must be a non-empty list of token ids")
        for t in self.end_token_ids:
            _check_int("reasoning", t, lo=0)
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget, lo=0)


class LogitsProcessorSpec(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A per-request logits processor named by its qualified name (vLLM's ``logits_processors`` request field).

    Attributes:
        qualname: ``"package.module:Name"`` or ``"package.module.Name"``; allowed only when it matches the
            engine's ``--logits-processor-pattern`` (see :mod:`tokenmill.worker.request_logits_processors`).
        args, kwargs: when either is given, ``Name`` is a factory called with them and its result is the
            processor; otherwise ``Name`` itself is the processor.
    """

    qualname: str
    args: list[Any] | None = None
    kwargs: dict[str, Any] | None = None


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Parameters of one request's generation.

    Attributes:
        n: number of output sequences for the prompt.
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling: keep the smallest set of tokens whose probability sums to ``top_p``; 1 = off.
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 = off.
        min_p: drop tokens whose probability is below ``min_p`` times the top token's; 0 = off.
        seed: per-request random seed (same seed, same output whatever else is batched).
        presence_penalty: subtracted from the logit of every token already generated (OpenAI semantics).
        frequency_penalty: subtracted once per occurrence of a token already generated (OpenAI semantics).
        repetition_penalty: divides positive / multiplies negative logits of tokens in prompt or output
            (CTRL paper, Keskar et al. 2019); 1 = off.
        max_tokens: most tokens to generate; ``None``: up to the model's context length.
        min_tokens: EOS and stop token ids are suppressed until this many tokens are generated.
        stop: strings that end generation when they appear in the output (not included unless
            ``include_stop_str_in_output``).
        stop_token_ids: token ids that end generation (included in token ids, not in text).
        ignore_eos: keep generating after the EOS token.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: leave special tokens out of the detokenized text.
        spaces_between_special_tokens: put spaces around special tokens in the text.
        logprobs: number of top log-probabilities to return per generated token (``None``: none).
        prompt_logprobs: number of top log-probabilities to return per prompt token.
        detokenize: produce text (otherwise only token ids).
        extra_args: free-form settings for plugins' logits processors (vLLM's ``extra_args``); tokenmill itself
            ignores them.
        output_kind: what the front end yields while the request runs.
        logit_bias: token id -> bias added to its logit before sampling (OpenAI semantics; each value is
            clamped to [-100, 100]).
        allowed_token_ids: when set, every other token's logit is -inf.
        bad_words: words never to generate (tokenized by the front end into ``bad_words_token_ids``).
        bad_words_token_ids: token sequences never to generate: the last token of a sequence is banned
            whenever the output ends with the sequence's other tokens.
        structured_outputs: a constraint the output must follow (JSON schema, regex, choice, grammar), see
            :class:`StructuredOutputsParams`; ``None``: unconstrained.
        reasoning: the thinking of a reasoning model (its end marker and budget), see :class:`ReasoningParams`;
            ``None``: the output has no thinking (a grammar applies from the first token).
        logits_processors: per-request logits processors, see :class:`LogitsProcessorSpec` (refused unless the
            engine runs with ``--logits-processor-pattern``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    extra_args: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    reasoning: ReasoningParams | None = None
    logits_processors: list[LogitsProcessorSpec] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.validate()
        if self.logit_bias is not None:
            # OpenAI clamps biases to [-100, 100]; keys may arrive as decimal strings from JSON.
            self.logit_bias = {int(k): min(100.0, max(-100.0, float(v))) for k, v in self.logit_bias.items()}

    def validate(self) -> None:
        """Check every field; raises :class:`SamplingParamsError` naming the first bad one."""
        _check_int("n", self.n, lo=1)
        if self.n > 128:
            raise SamplingParamsError("n", f"must be at most 128, got {self.n}")
        _check_float("temperature", self.temperature, lo=0.0)
        _check_float("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        _check_int("top_k", self.top_k, lo=-1)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=_INT64_MIN, hi=_INT64_MAX)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for s in self.stop:
            if not isinstance(s, str):
                raise SamplingParamsError("stop", f"must be strings, got {type(s).__name__}")
            if s == "":
                raise SamplingParamsError("stop", "must not contain an empty string")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, lo=0)
                if value > MAX_LOGPROBS:
                    raise SamplingParamsError(name, f"must be at most {MAX_LOGPROBS}, got {value}")
        self._validate_token_controls()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise SamplingParamsError(
                    "structured_outputs", f"must be a StructuredOutputsParams, got {self.structured_outputs!r}"
                )
            self.structured_outputs.validate()
        if self.reasoning is not None:
            if not isinstance(self.reasoning, ReasoningParams):
                raise SamplingParamsError("reasoning", f"must be a ReasoningParams, got {self.reasoning!r}")
            self.reasoning.validate()

    def _validate_token_controls(self) -> None:
        """``logit_bias``, ``allowed_token_ids``, ``bad_words`` and ``bad_words_token_ids``.

        Token ids are only checked to be non-negative here; the engine checks them against the vocabulary.
        """
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingParamsError(
                    "logit_bias", f"must be a mapping of token id to bias, got {self.logit_bias!r}"
                )
            for k, v in self.logit_bias.items():
                if isinstance(k, str):
                    try:
                        k = int(k)
                    except ValueError:
                        msg = f"keys must be token ids (integers), got {k!r}"
                        raise SamplingParamsError("logit_bias", msg) from None
                _check_int("logit_bias", k, lo=0)
                _check_float("logit_bias", v)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise SamplingParamsError("allowed_token_ids", "must be a non-empty list of token ids")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, lo=0)
        if self.bad_words is not None:
            for w in self.bad_words:
                if not isinstance(w, str):
                    raise SamplingParamsError("bad_words", f"must be strings, got {type(w).__name__}")
        if self.bad_words_token_ids is not None:
            for seq in self.bad_words_token_ids:
                if not isinstance(seq, list) or not seq:
                    raise SamplingParamsError("bad_words_token_ids", "must be non-empty lists of token ids")
                for t in seq:
                    _check_int("bad_words_token_ids", t, lo=0)

    @property
    def is_greedy(self) -> bool:
        """Whether tokens are picked by argmax (``temperature`` below :data:`SAMPLING_EPS`)."""
        return self.temperature < SAMPLING_EPS

    def clone(self) -> SamplingParams:
        return msgspec.structs.replace(self)


def _check_int(name: str, value: object, *, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise SamplingParamsError(name, f"must be at least {lo}, got {value}")
    if hi is not None and value > hi:
        raise SamplingParamsError(name, f"must be at most {hi}, got {value}")


def _check_float(
    name: str, value: object, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsError(name, f"must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise SamplingParamsError(name, f"must be finite, got {value}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise SamplingParamsError(name, f"must be {'greater than' if lo_open else 'at least'} {lo}, got {value}")
    if hi is not None and value > hi:
        raise SamplingParamsError(name, f"must be at most {hi}, got {value}")
