"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's request and response shapes).

``/tokenize`` takes either ``{"prompt": "..."}`` (``add_special_tokens`` defaults to true) or chat
``{"messages": [...]}`` rendered by the chat template first (``add_generation_prompt`` true and
``add_special_tokens`` false by default, as for chat completions, so the ids are exactly what a chat
completion would feed the model).
"""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from tokenmill.entrypoints.openai.responses import DetokenizeResponse, TokenizeResponse
from tokenmill.entrypoints.openai.serving_engine import OpenAIServing
from tokenmill.errors import InvalidRequestError


def parse_tokenize_request(data: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The request model for a ``/tokenize`` body: chat when it has ``messages``, else prompt.

    Raises:
        pydantic.ValidationError: a field is invalid or missing.
        InvalidRequestError: a field the request model does not accept.
    """
    model = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
    return model.model_validate(model.check_request_fields(data))


class OpenAIServingTokenization(OpenAIServing):
    """Handles ``/tokenize`` and ``/detokenize`` (chat messages go through the same chat template as chat
    completions)."""

    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """Raises ModelNotFoundError (unknown model) or InvalidRequestError (template failure)."""
        self.models.resolve(request.model)
        if isinstance(request, TokenizeChatRequest):
            request.check_template_fields()
        tokens, strs = await self.tokenization.run(self._tokenize, request)
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens,
                                token_strs=strs)

    def _tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest
                  ) -> tuple[list[int], list[str] | None]:
        if isinstance(request, TokenizeChatRequest):
            tokens = self.encode_chat(
                [m.to_template_dict() for m in request.messages],
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                template_kwargs=request.chat_template_kwargs,
                add_special_tokens=request.add_special_tokens,
            )
        else:
            tokens = self.tokenization.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        return tokens, self.tokenization.token_strs(tokens) if request.return_token_strs else None

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """Raises ModelNotFoundError (unknown model) or InvalidRequestError (ids outside the vocabulary)."""
        self.models.resolve(request.model)
        if not isinstance(request.tokens, list):
            raise InvalidRequestError("tokens: must be a list of token ids", param="tokens")
        self.check_token_ids(request.tokens, "tokens")
        text = await self.tokenization.run(self.tokenization.decode, request.tokens)
        return DetokenizeResponse(prompt=text)
