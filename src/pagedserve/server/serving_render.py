"""POST /v1/completions/render and /v1/chat/completions/render: a request's token ids as the engine would see them.

A cache-aware router (llm-d's endpoint picker) renders a request here, hashes its token ids block by block as
the engine does, and scores each replica by the blocks its KV events say it holds. The answer is vLLM's
GenerateRequest (the body of its tokens-in endpoint): one object for a chat, a list (one per prompt) for a
completion. The same checks as the real endpoints run (model name, limits, template, vocabulary), so a request
that renders would also be accepted; nothing reaches the engine thread.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel, RootModel

from pagedserve.sampling_params import SamplingParams
from pagedserve.server.context import random_id
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.server.serving_chat import OpenAIServingChat
from pagedserve.server.serving_completion import OpenAIServingCompletion
from pagedserve.server.streaming import json_response


class RenderedRequest(BaseModel):
    request_id: str
    token_ids: list[int]
    features: dict[str, Any] | None = None   # multimodal placeholders: none for text models
    sampling_params: dict[str, Any]
    model: str
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None


class RenderedRequests(RootModel[list[RenderedRequest]]):
    pass


def sampling_params_json(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> dict[str, Any]:
    # max_tokens as the engine resolves it (unset: the rest of the context), so a router can budget with it.
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
           if f.name not in ("output_kind", "structured_outputs")}
    if out["max_tokens"] is None:
        out["max_tokens"] = max_model_len - num_prompt_tokens
    if params.structured_outputs is not None:
        out["structured_outputs"] = {k: v for k, v in dataclasses.asdict(params.structured_outputs).items()
                                     if v is not None}
    return out


def register_render_routes(app: FastAPI, completion: OpenAIServingCompletion, chat: OpenAIServingChat) -> None:
    model_name = completion.ctx.model_name
    max_model_len = completion.ctx.engine.max_model_len

    def rendered(request_id: str, token_ids: list[int], params: SamplingParams, stream: bool,
                 cache_salt: str | None, priority: int) -> RenderedRequest:
        return RenderedRequest(request_id=request_id, token_ids=token_ids, model=model_name, stream=stream,
                               sampling_params=sampling_params_json(params, len(token_ids), max_model_len),
                               cache_salt=cache_salt, priority=priority)

    @app.post("/v1/completions/render")
    async def render_completion(req: CompletionRequest) -> Response:
        params, tokenized = await completion.prepare(req)
        request_id = random_id("cmpl")
        return json_response(RenderedRequests([rendered(f"{request_id}-{i}", ids, params, req.stream, req.cache_salt,
                                                        req.priority)
                                               for i, (_, ids, _) in enumerate(tokenized)]))

    @app.post("/v1/chat/completions/render")
    async def render_chat(req: ChatCompletionRequest) -> Response:
        params, prompt = await chat.prepare(req)
        return json_response(rendered(random_id("chatcmpl"), list(prompt["prompt_token_ids"]), params, req.stream,
                                      req.cache_salt, req.priority))
