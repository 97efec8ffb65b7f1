"""SpeculativeConfig: how (and whether) the engine proposes draft tokens for the target model to verify.

The field names are vLLM's (``--speculative-config`` takes the same JSON object): ``method``,
``num_speculative_tokens``, ``prompt_lookup_max`` / ``prompt_lookup_min`` (n-gram prompt lookup) and ``model``
(a draft model). See docs/speculative_decoding.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tokenmill.config import parse_json_object

SPEC_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding settings (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
    Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").

    Attributes:
        method: ``"ngram"`` (prompt lookup: the tokens that followed the latest earlier occurrence of the
            sequence's last n tokens) or ``"draft_model"`` (a smaller model with the same vocabulary).
        num_speculative_tokens: K, draft tokens proposed per request and step (each step then yields 1 to
            K + 1 tokens).
        prompt_lookup_max: longest n-gram matched (``ngram``; default K).
        prompt_lookup_min: shortest n-gram matched (``ngram``; default 1).
        model: the draft model (``draft_model``): a Hugging Face directory or a ``.gguf`` file.
        draft_model_config: the draft's :class:`tokenmill.config.ModelConfig`, filled in by the engine.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    draft_model_config: Any = None

    @classmethod
    def from_user(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """Build from a dict (``LLM(speculative_config=...)``) or a JSON string (``--speculative-config``).

        A dict without ``method`` but with ``model`` means ``draft_model`` (with neither: ``ngram``).

        Raises:
            ValueError: not a JSON object, an unknown key, or a value out of range (the message names the key).
        """
        if isinstance(value, SpeculativeConfig):
            config = value
        else:
            value = parse_json_object(value, "speculative_config")
            known = {f.name for f in fields(cls)} - {"draft_model_config"}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"speculative_config: unknown key(s) {unknown}; known keys: {sorted(known)}")
            value = dict(value)
            if "method" not in value:
                value["method"] = "draft_model" if value.get("model") else "ngram"
            if value["method"] == "draft":  # vLLM's older spelling
                value["method"] = "draft_model"
            config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        """Check and fill in defaults.

        Raises:
            ValueError: the message starts with ``speculative_config.<key>``.
        """
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method: must be one of {list(SPEC_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens: must be an integer >= 1, got {k!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model: only the draft_model method takes a model")
            lo = 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
            hi = max(k, lo) if self.prompt_lookup_max is None else self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"speculative_config.{name}: must be an integer >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(
                    f"speculative_config.prompt_lookup_min: {lo} is larger than prompt_lookup_max {hi}"
                )
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        else:
            if not self.model or not isinstance(self.model, str):
                raise ValueError("speculative_config.model: the draft_model method needs the draft model's path")
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name}: only the ngram method takes it")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved past a request's scheduled tokens each step: a draft model writes its own KV for
        the newly sampled token and the first K - 1 drafts there, before the next step schedules them."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    def summary(self) -> str:
        if self.method == "ngram":
            return (f"ngram (K={self.num_speculative_tokens}, n-gram {self.prompt_lookup_min}.."
                    f"{self.prompt_lookup_max})")
        return f"draft_model {self.model} (K={self.num_speculative_tokens})"
