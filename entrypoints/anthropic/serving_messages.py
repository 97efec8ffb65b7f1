"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` over the chat completion handler.

A Messages request is translated into a chat completion request (:mod:`tokenmill.entrypoints.anthropic.translate`)
and run by :class:`~tokenmill.entrypoints.openai.serving_chat.OpenAIServingChat` exactly as one sent to
``/v1/chat/completions`` (same checks, chat template, tool parsers, grammar engine, metrics); its JSON response
or SSE stream is translated back. ``count_tokens`` renders the prompt the same handler would run.
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import Response
from starlette.responses import StreamingResponse
from tokenmill.entrypoints.anthropic.protocol import CountTokensRequest, CountTokensResponse, MessagesRequest
from tokenmill.entrypoints.anthropic.streaming import anthropic_events
from tokenmill.entrypoints.anthropic.translate import to_chat_request, to_message
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.streaming import sse_response


class AnthropicServingMessages:
    """Serves the Messages API with ``chat``, the server's chat completion handler."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, request: MessagesRequest, raw_request: Request) -> Response:
        """Run one Messages request.

        Raises:
            ModelNotFoundError, InvalidRequestError, EngineDeadError, EngineGenerateError: as the chat handler
                (the Anthropic error middleware gives them Anthropic's shape).
        """
        response = await self.chat.create_chat_completion(
            to_chat_request(request, self.chat.reasoning_parser_cls is not None), raw_request)
        if response.status_code != 200:  # the client went away (499): nobody reads the body
            return response
        if isinstance(response, StreamingResponse):
            return sse_response(anthropic_events(response.body_iterator,  # type: ignore[arg-type]
                                                 request.stop_sequences))
        message = to_message(json.loads(bytes(response.body)), request)
        return Response(message.model_dump_json(), media_type="application/json")

    async def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        """The number of prompt tokens the request would use (system, turns and tools, through the chat
        template).

        Raises:
            ModelNotFoundError: unknown ``model``.
            InvalidRequestError: a bad turn, tool or tool choice, or the template failed.
        """
        chat = self.chat
        chat.models.resolve(request.model)
        chat_request = to_chat_request(request, self.chat.reasoning_parser_cls is not None)
        chat_request.check()
        prompt_ids, _ = await chat.tokenization.run(chat._render_and_encode, chat_request)  # ids, images
        return CountTokensResponse(input_tokens=len(prompt_ids))
