"""POST /v1/completions: prompts in, text out, streamed as SSE or returned whole."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pagedserve.engine.async_engine import EngineClosedError, OutputStream
from pagedserve.outputs import Logprob, RequestOutput
from pagedserve.server.context import ServerContext, random_id, usage_of
from pagedserve.server.errors import OpenAIError
from pagedserve.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                        CompletionResponse, CompletionStreamResponse)
from pagedserve.server.streaming import SSE_DONE, SSEResponse, json_response, sse, unless_disconnected


def legacy_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int,
                    text_offset: int) -> CompletionLogprobs:
    # The completions API's format: parallel lists, top alternatives keyed by token text, and each token's
    # character offset in the returned text (which includes the prompt when echo is on).
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries):
        sampled = entry.get(token_id)
        token = (sampled.decoded_token or "") if sampled else ""
        out.tokens.append(token)
        out.token_logprobs.append(sampled.logprob if sampled else None)
        ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))
        top = {(lp.decoded_token or ""): lp.logprob for tid, lp in ranked[:num_top]}
        if sampled is not None:
            top.setdefault(token, sampled.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out


@dataclass(slots=True)
class _ChoiceState:
    # How much of a choice's cumulative output the client has already been sent.
    num_chars: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    started: bool = False
    done: bool = False


class OpenAIServingCompletion:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def create(self, req: CompletionRequest, raw_request: Request) -> Response:
        self.ctx.check_model(req.model)
        params = req.to_sampling_params(req.max_tokens, req.logprobs)
        prompts = req.prompts()
        request_id = random_id("cmpl")
        engine = self.ctx.engine
        echo_texts: list[str] = [""] * len(prompts)
        if req.echo and all(isinstance(p, str) for p in prompts):
            echo_texts = list(prompts)  # type: ignore[arg-type]
        elif req.echo:  # token-id prompts are echoed as their text, decoded on the engine thread
            echo_texts = await engine.call(lambda e: [p if isinstance(p, str) else e.tokenizer.decode(p)
                                                      for p in prompts])
        sub_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = await engine.add_requests([(rid, p, params) for rid, p in zip(sub_ids, prompts)])
        created = int(time.time())
        if req.stream:
            return SSEResponse(self._stream(req, stream, request_id, created, sub_ids, echo_texts),
                               on_close=stream.close)
        try:
            finals = await unless_disconnected(raw_request, _collect(stream, sub_ids))
        finally:
            stream.close()
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                logprobs = None
                if req.logprobs is not None and c.logprobs is not None:
                    logprobs = legacy_logprobs(c.token_ids, c.logprobs[:len(c.token_ids)], req.logprobs,
                                               len(echo_texts[i]))
                choices.append(CompletionChoice(index=i * req.n + c.index, text=echo_texts[i] + c.text,
                                                logprobs=logprobs, finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason))
        body = CompletionResponse(id=request_id, created=created, model=self.ctx.model_name,
                                  choices=choices, usage=usage_of(finals))
        return json_response(body)

    async def _stream(self, req: CompletionRequest, stream: OutputStream, request_id: str, created: int,
                      sub_ids: list[str], echo_texts: list[str]) -> AsyncIterator[str]:
        index_of = {rid: i for i, rid in enumerate(sub_ids)}
        states: dict[int, _ChoiceState] = {}
        latest: dict[str, RequestOutput] = {}
        model = self.ctx.model_name
        try:
            async for out in stream:
                latest[out.request_id] = out
                i = index_of[out.request_id]
                for c in out.outputs:
                    index = i * req.n + c.index
                    st = states.setdefault(index, _ChoiceState(text_offset=len(echo_texts[i])))
                    if st.done:
                        continue
                    text = c.text[st.num_chars:]
                    if not st.started and echo_texts[i]:
                        text = echo_texts[i] + text
                    new_tokens = c.token_ids[st.num_tokens:]
                    want_logprobs = req.logprobs is not None and c.logprobs is not None
                    if not text and c.finish_reason is None and not (want_logprobs and new_tokens):
                        continue
                    logprobs = None
                    if want_logprobs:
                        logprobs = legacy_logprobs(new_tokens, c.logprobs[st.num_tokens:len(c.token_ids)],
                                                   req.logprobs, st.text_offset)
                        if logprobs.text_offset:
                            st.text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                    st.num_chars, st.num_tokens = len(c.text), len(c.token_ids)
                    st.started, st.done = True, c.finish_reason is not None
                    choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                    yield sse(CompletionStreamResponse(id=request_id, created=created, model=model,
                                                       choices=[choice]))
            if req.include_usage:
                yield sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                   usage=usage_of(list(latest.values()))))
        except EngineClosedError as exc:
            yield OpenAIError(str(exc), 503).sse_payload()
        except Exception as exc:  # noqa: BLE001 (the response has started; report in-band)
            yield OpenAIError(str(exc), 500).sse_payload()
        finally:
            stream.close()
        yield SSE_DONE


async def _collect(stream: OutputStream, sub_ids: list[str]) -> list[RequestOutput]:
    latest: dict[str, RequestOutput] = {}
    async for out in stream:
        latest[out.request_id] = out
    return [latest[rid] for rid in sub_ids]
