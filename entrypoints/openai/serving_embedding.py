"""``POST /v1/embeddings`` (OpenAI's request and response, with vLLM's chat-style ``messages`` input) and
``POST /classify`` (vLLM's shape)."""

from __future__ import annotations

import base64

from tokenmill.entrypoints.openai.protocol import UsageInfo
from tokenmill.entrypoints.openai.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingChatRequest,
    EmbeddingCompletionRequest,
    EmbeddingData,
    EmbeddingResponse,
)
from tokenmill.entrypoints.openai.serving_pooling import OpenAIServingPooling, input_prompts


class OpenAIServingEmbedding(OpenAIServingPooling):
    """Handles ``/v1/embeddings`` (chat ``messages`` are rendered with the app's chat template) and
    ``/classify``."""

    async def create_embedding(self, request: EmbeddingCompletionRequest | EmbeddingChatRequest
                               ) -> EmbeddingResponse:
        """Raises ModelNotFoundError, or InvalidRequestError (a generation model, too long an input without
        ``truncate_prompt_tokens``, unsupported ``dimensions``, ...; ``param`` names the field)."""
        model_name = self.models.resolve(request.model)
        self.check_priority(request.priority)
        self.check_task("embed")
        params = request.to_pooling_params()
        if isinstance(request, EmbeddingChatRequest):
            request.check_template_fields()
            text = await self.tokenization.run(
                self.renderer.render, [m.to_template_dict() for m in request.messages],
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                template_kwargs=request.chat_template_kwargs,
            )
            token_lists = await self.tokenize_all([text], request.add_special_tokens, "messages")
            param = "messages"
        else:
            token_lists = await self.tokenize_all(input_prompts(request.input), request.add_special_tokens)
            param = "input"
        outputs = await self.encode_all(token_lists, params, model_name=model_name, priority=request.priority,
                                        param=param)
        data = []
        for i, out in enumerate(outputs):
            values = out.outputs.data
            embedding: list[float] | str
            if request.encoding_format == "base64":
                embedding = base64.b64encode(values.numpy().astype("<f4").tobytes()).decode("ascii")
            else:
                embedding = values.tolist()
            data.append(EmbeddingData(index=i, embedding=embedding))
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return EmbeddingResponse(model=model_name, data=data, usage=UsageInfo(prompt_tokens=num_tokens,
                                                                              total_tokens=num_tokens))

    async def create_classification(self, request: ClassificationRequest) -> ClassificationResponse:
        """Raises ModelNotFoundError, or InvalidRequestError (not a classifier, too long an input, ...)."""
        model_name = self.models.resolve(request.model)
        self.check_priority(request.priority)
        self.check_task("classify")
        token_lists = await self.tokenize_all(input_prompts(request.input), request.add_special_tokens)
        outputs = await self.encode_all(token_lists, request.to_pooling_params(), model_name=model_name,
                                        priority=request.priority)
        id2label = getattr(self.engine.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, out in enumerate(outputs):
            probs = out.outputs.data.tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=i, label=id2label.get(best), probs=probs, num_classes=len(probs)))
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return ClassificationResponse(model=model_name, data=data,
                                      usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens))
