"""POST /v1/chat/completions: messages through the model's chat template, answers streamed or whole."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pagedserve.engine.async_engine import OutputStream
from pagedserve.engine.processor import ChatPrompt
from pagedserve.outputs import Logprob, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.server.context import ServerContext, random_id, usage_of
from pagedserve.server.errors import OpenAIError
from pagedserve.server.prompt_logprobs import prompt_logprobs_field
from pagedserve.server.protocol import (ChatChoice, ChatChoiceLogprobs, ChatCompletionRequest,
                                        ChatCompletionResponse, ChatCompletionStreamResponse,
                                        ChatLogprobEntry, ChatStreamChoice,
                                        ChatTopLogprob, DeltaMessage, UsageInfo)
from pagedserve.server.streaming import SSE_DONE, SSEResponse, StreamChunks, json_response, sse, unless_disconnected
from pagedserve.server.tool_calls import tool_grammar
from pagedserve.server.tool_stream import ChoiceStreamer, final_message


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int) -> ChatChoiceLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries):
        sampled = entry.get(token_id)
        if sampled is None:
            continue
        ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))
        top = [_top(lp) for _, lp in ranked[:num_top]]
        token = sampled.decoded_token or ""
        content.append(ChatLogprobEntry(token=token, logprob=sampled.logprob, bytes=list(token.encode()),
                                        top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


def _top(lp: Logprob) -> ChatTopLogprob:
    token = lp.decoded_token or ""
    return ChatTopLogprob(token=token, logprob=lp.logprob, bytes=list(token.encode()))


class OpenAIServingChat:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def prepare(self, req: ChatCompletionRequest) -> tuple[SamplingParams, dict[str, Any]]:
        # The checks, the sampling parameters and the rendered prompt; /v1/chat/completions/render stops here.
        self.ctx.limits.check_samples(req.n)
        self.ctx.check_model(req.model)
        self.ctx.check_priority(req.priority)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        num_top = req.top_logprobs or 0
        if req.tool_mode == "auto" and self.ctx.tool_call_parser is None:
            raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                              "to be set", 400, param="tool_choice")
        params = req.to_sampling_params(max_tokens, num_top if req.logprobs else None,
                                        prompt_logprobs=req.prompt_logprobs)
        params.structured_outputs = tool_grammar(req) or params.structured_outputs
        params.output_kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        messages = [m.to_template_dict() for m in req.messages]
        template_kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            template_kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        if req.documents:
            template_kwargs["documents"] = req.documents
        engine = self.ctx.engine
        prompt = await engine.render_chat(ChatPrompt(messages, req.add_generation_prompt,
                                                     template_kwargs=template_kwargs, cache_salt=req.cache_salt),
                                          req.priority)
        self.ctx.limits.check_tokens([len(prompt["prompt_token_ids"])], max_tokens, req.n, engine.max_model_len)
        return params, prompt

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        params, prompt = await self.prepare(req)
        num_top = req.top_logprobs or 0
        request_id = random_id("chatcmpl")
        engine = self.ctx.engine
        stream = await engine.add_request(request_id, prompt, params, req.priority)
        created = int(time.time())
        if req.stream:
            return SSEResponse(self._stream(req, stream, request_id, created), on_close=stream.close)
        try:
            final = await unless_disconnected(raw_request, _last(stream))
        finally:
            stream.close()
        choices = []
        for c in final.outputs:
            logprobs = None
            if req.logprobs and c.logprobs is not None:
                logprobs = chat_logprobs(c.token_ids, c.logprobs[:len(c.token_ids)], num_top)
            message, finish_reason = final_message(req, c.text, c.finish_reason, self.ctx.tool_call_parser,
                                                   self.ctx.reasoning_parser)
            choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                      finish_reason=finish_reason, stop_reason=c.stop_reason))
        prompt_field = (None if req.prompt_logprobs is None else
                        prompt_logprobs_field(final.prompt_token_ids, final.prompt_logprobs, req.prompt_logprobs))
        body = ChatCompletionResponse(id=request_id, created=created, model=self.ctx.model_name,
                                      choices=choices, usage=usage_of([final]), prompt_logprobs=prompt_field)
        return json_response(body)

    async def _stream(self, req: ChatCompletionRequest, stream: OutputStream, request_id: str,
                      created: int) -> AsyncIterator[str]:
        model = self.ctx.model_name
        num_top = req.top_logprobs or 0

        chunks = StreamChunks(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[]))
        chunk = chunks.event

        try:
            # As OpenAI does, each choice opens with the assistant role and empty content.
            for i in range(req.n):
                yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            num_prompt_tokens = num_completion_tokens = 0
            streamers = {i: ChoiceStreamer(req, self.ctx.tool_call_parser, self.ctx.reasoning_parser)
                         for i in range(req.n)}
            async for out in stream:  # DELTA outputs: only what is new since the previous one
                num_prompt_tokens = len(out.prompt_token_ids)
                for c in out.outputs:
                    num_completion_tokens += len(c.token_ids)
                    logprobs = None
                    if req.logprobs and c.logprobs is not None:
                        logprobs = chat_logprobs(c.token_ids, c.logprobs, num_top)
                    delta, finish_reason = streamers[c.index].delta(c.text, c.finish_reason)
                    if (not delta.content and not delta.reasoning_content and not delta.tool_calls
                            and finish_reason is None and not (logprobs and logprobs.content)):
                        continue
                    if (logprobs is None and delta.role is None and delta.reasoning_content is None
                            and delta.tool_calls is None):
                        yield chunks.content(c.index, delta.content, finish_reason, c.stop_reason)
                        continue
                    yield chunk(ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                                                 finish_reason=finish_reason, stop_reason=c.stop_reason))
            if req.include_usage:
                yield sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                       usage=UsageInfo(prompt_tokens=num_prompt_tokens,
                                                                       completion_tokens=num_completion_tokens,
                                                                       total_tokens=num_prompt_tokens
                                                                       + num_completion_tokens)))
        except Exception as exc:  # noqa: BLE001 (the response has started; report in-band)
            yield OpenAIError.in_band(exc).sse_payload()
        finally:
            stream.close()
        yield SSE_DONE


async def _last(stream: OutputStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    if last is None:
        raise RuntimeError("the request ended without output")
    return last
