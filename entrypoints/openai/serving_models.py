"""The models this server serves: ``GET /v1/models`` and the ``model`` field of every request."""

from __future__ import annotations

import time

from tokenmill.entrypoints.openai.errors import ModelNotFoundError
from tokenmill.entrypoints.openai.responses import ModelCard, ModelList


class OpenAIServingModels:
    """Knows the served model name(s) and answers which name a request means.

    Args:
        served_model_names: names the API accepts; the first one is reported in responses.
        root: where the model was loaded from (reported as ``root`` in the model card).
        max_model_len: context length in tokens.
    """

    def __init__(self, served_model_names: list[str], root: str | None, max_model_len: int) -> None:
        if not served_model_names:
            raise ValueError("served_model_names: at least one name is needed")
        self.served_model_names = list(served_model_names)
        self.root = root
        self.max_model_len = max_model_len
        self.created = int(time.time())

    @property
    def default_name(self) -> str:
        return self.served_model_names[0]

    def resolve(self, requested: str | None) -> str:
        """The name to report for a request asking for ``requested`` (``None`` or ``""``: the default model).

        Raises:
            ModelNotFoundError: ``requested`` is not served here.
        """
        if requested is None or requested == "":
            return self.default_name
        if requested in self.served_model_names:
            return requested
        raise ModelNotFoundError(requested)

    def card(self, name: str) -> ModelCard:
        """Raises ModelNotFoundError for a name not served here."""
        return ModelCard(id=self.resolve(name), created=self.created, root=self.root,
                         max_model_len=self.max_model_len)

    def list_models(self) -> ModelList:
        return ModelList(data=[self.card(name) for name in self.served_model_names])
