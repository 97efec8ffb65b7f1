"""What the pooling routes share: inputs -> token ids (off the event loop), the runner check, and running
many pooling requests of one HTTP request concurrently through ``AsyncLLM.encode``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.entrypoints.openai.protocol import random_id
from tokenmill.entrypoints.openai.serving_engine import OpenAIServing, ServingContext, gather_or_cancel
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import PoolingRequestOutput
from tokenmill.pooler_config import supported_pooling_tasks
from tokenmill.pooling_params import PoolingParams

# Most prompts one request may carry; more is refused rather than queued.
MAX_INPUTS_PER_REQUEST = 2048


def input_prompts(value: Any, param: str = "input") -> list[str | list[int]]:
    """An OpenAI ``input`` (a string, strings, token ids, or token-id lists) as a list of prompts.

    Raises:
        InvalidRequestError: an empty input, or more than ``MAX_INPUTS_PER_REQUEST`` prompts.
    """
    if isinstance(value, str):
        prompts: list[str | list[int]] = [value]
    elif value and all(isinstance(v, int) for v in value):
        prompts = [list(value)]
    else:
        prompts = [v if isinstance(v, str) else list(v) for v in value]
    if not prompts:
        raise InvalidRequestError(f"{param}: must not be empty", param=param)
    if len(prompts) > MAX_INPUTS_PER_REQUEST:
        raise InvalidRequestError(f"{param}: at most {MAX_INPUTS_PER_REQUEST} inputs per request, got "
                                  f"{len(prompts)}", param=param)
    return prompts


class OpenAIServingPooling(OpenAIServing):
    """Base of the embedding, classification and score handlers."""

    def __init__(self, context: ServingContext) -> None:
        super().__init__(context)
        mc = self.engine.model_config
        self.runner_type = str(getattr(mc, "runner_type", "generate"))
        self.convert = str(getattr(mc, "convert", "none"))

    def check_task(self, task: str) -> None:
        """Raises InvalidRequestError (``param="model"``) naming the runner when the model cannot do ``task``."""
        if self.runner_type != "pooling":
            raise InvalidRequestError(
                f"this model is served with the {self.runner_type!r} runner, which does not do {task} requests; "
                "serve an embedding or classification model (or pass --runner pooling)", param="model",
            )
        if task not in supported_pooling_tasks(self.convert):
            tasks = ", ".join(supported_pooling_tasks(self.convert))
            raise InvalidRequestError(f"this model (--convert {self.convert}) serves {tasks}, not {task}",
                                      param="model")

    async def tokenize_all(self, prompts: Sequence[str | list[int]], add_special_tokens: bool,
                           param: str = "input") -> list[list[int]]:
        """Token ids of every prompt (text is tokenized in the tokenizer thread; ids are checked)."""
        def run() -> list[list[int]]:
            return [self.tokenization.encode(p, add_special_tokens) if isinstance(p, str) else list(p)
                    for p in prompts]

        token_lists = await self.tokenization.run(run)
        for ids in token_lists:
            self.check_token_ids(ids, param)
        return token_lists

    async def encode_all(self, token_lists: Sequence[list[int]], params: PoolingParams, *,
                         model_name: str | None = None, priority: int = 0, param: str = "input",
                         ) -> list[PoolingRequestOutput]:
        """Run every prompt as its own pooling request, concurrently (the engine batches them); on any failure
        the others are cancelled (and so aborted)."""
        base = random_id("pool")
        lora_request = self.models.lora_request(model_name)
        extra: dict[str, Any] = {"priority": priority} if priority else {}
        if lora_request is not None:
            extra["lora_request"] = lora_request
        return await gather_or_cancel(*(self.engine.encode(ids, params, f"{base}-{i}", prompt_param=param, **extra)
                                         for i, ids in enumerate(token_lists)))
