"""POST /v1/completions: prompts in, text out, streamed as SSE or returned whole."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pagedserve.engine.async_engine import OutputStream
from pagedserve.outputs import Logprob, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.server.context import ServerContext, random_id, usage_of
from pagedserve.server.errors import OpenAIError
from pagedserve.server.prompt_logprobs import prompt_logprobs_field
from pagedserve.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                        CompletionResponse, CompletionStreamResponse, UsageInfo)
from pagedserve.server.streaming import SSE_DONE, SSEResponse, StreamChunks, json_response, sse, unless_disconnected


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


def echo_logprobs(out: RequestOutput, first_token: str, num_top: int) -> CompletionLogprobs:
    # OpenAI's echo with logprobs: the prompt's tokens come first. Nothing predicts the first one, so its
    # logprob and top alternatives are null; first_token is its text (the output processor's memoized decode, on the event loop).
    entries = (out.prompt_logprobs or [None])[1:]
    rest = legacy_logprobs(out.prompt_token_ids[1:], entries, num_top, len(first_token))  # type: ignore[arg-type]
    return joined(CompletionLogprobs(text_offset=[0], token_logprobs=[None], tokens=[first_token],
                                     top_logprobs=[None]), rest)


def joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset,
                              token_logprobs=a.token_logprobs + b.token_logprobs, tokens=a.tokens + b.tokens,
                              top_logprobs=a.top_logprobs + b.top_logprobs)


def end_offset(lp: CompletionLogprobs) -> int:
    # Where the next token's text_offset continues.
    return lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else 0


def first_token_texts(ctx: ServerContext, outs: list[RequestOutput]) -> list[str]:
    texts = ctx.engine.output_processor.token_texts  # memoized single-token decodes, event loop side
    return [texts(o.prompt_token_ids[0]) for o in outs]


def tokenized_prompt(text: str | None, token_ids: list[int], cache_salt: str | None) -> dict:
    # What the Processor takes without tokenizing again: the ids, the text it came from, the salt.
    prompt: dict = {"prompt_token_ids": token_ids}
    if text is not None:
        prompt["prompt"] = text
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


@dataclass(slots=True)
class _ChoiceState:
    text_offset: int = 0   # where the next token's text starts in the choice's whole text
    started: bool = False  # the echoed prompt went out with the first chunk


class OpenAIServingCompletion:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def prepare(self, req: CompletionRequest) -> tuple[SamplingParams, list[tuple[str | None, list[int], str]]]:
        # Everything before the engine: the checks, the sampling parameters and each prompt's
        # (text, token ids, echo text). /v1/completions/render stops here.
        limits = self.ctx.limits
        num_samples = req.best_of or req.n
        limits.check_samples(req.n, req.best_of)
        prompts = req.prompts()
        limits.check_sequences(len(prompts), num_samples)
        self.ctx.check_model(req.model)
        self.ctx.check_priority(req.priority)
        params = req.to_sampling_params(req.max_tokens, req.logprobs, req.best_of, req.num_prompt_logprobs)
        params.output_kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        engine = self.ctx.engine

        tokenized = []
        for text, ids in await engine.tokenize(prompts, req.priority):
            # Token-id prompts are echoed as their text, decoded once their ids are known to be in the vocabulary.
            echo = "" if not req.echo else text if text is not None else await engine.detokenize(ids, req.priority)
            tokenized.append((text, ids, echo))
        limits.check_tokens([len(ids) for _, ids, _ in tokenized], req.max_tokens, num_samples,
                            engine.max_model_len)
        return params, tokenized

    async def create(self, req: CompletionRequest, raw_request: Request) -> Response:
        params, tokenized = await self.prepare(req)
        request_id = random_id("cmpl")
        engine = self.ctx.engine
        echo_texts = [echo for _, _, echo in tokenized]
        sub_ids = [f"{request_id}-{i}" for i in range(len(tokenized))]
        stream = await engine.add_requests([(rid, tokenized_prompt(text, ids, req.cache_salt), params)
                                            for rid, (text, ids, _) in zip(sub_ids, tokenized)], req.priority)
        created = int(time.time())
        if req.stream:
            return SSEResponse(self._stream(req, stream, request_id, created, sub_ids, echo_texts),
                               on_close=stream.close)
        try:
            finals = await unless_disconnected(raw_request, _collect(stream, sub_ids))
        finally:
            stream.close()
        echo_lp = req.echo and req.logprobs is not None
        first_texts = first_token_texts(self.ctx, finals) if echo_lp else []
        choices = []
        for i, out in enumerate(finals):
            prompt_lp = echo_logprobs(out, first_texts[i], req.logprobs) if echo_lp else None
            prompt_field = (None if req.prompt_logprobs is None else
                            prompt_logprobs_field(out.prompt_token_ids, out.prompt_logprobs, req.prompt_logprobs))
            for c in out.outputs:
                logprobs = None
                if req.logprobs is not None and c.logprobs is not None:
                    start = len(echo_texts[i]) if prompt_lp is None else end_offset(prompt_lp)
                    logprobs = legacy_logprobs(c.token_ids, c.logprobs[:len(c.token_ids)], req.logprobs, start)
                    if prompt_lp is not None:
                        logprobs = joined(prompt_lp, logprobs)
                choices.append(CompletionChoice(index=i * req.n + c.index, text=echo_texts[i] + c.text,
                                                logprobs=logprobs, finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason, prompt_logprobs=prompt_field))
        body = CompletionResponse(id=request_id, created=created, model=self.ctx.model_name,
                                  choices=choices, usage=usage_of(finals))
        return json_response(body)

    async def _stream(self, req: CompletionRequest, stream: OutputStream, request_id: str, created: int,
                      sub_ids: list[str], echo_texts: list[str]) -> AsyncIterator[str]:
        index_of = {rid: i for i, rid in enumerate(sub_ids)}
        states: dict[int, _ChoiceState] = {}
        # Per prompt: the echoed prompt's logprobs, sent ahead of each choice's first tokens.
        prompt_lps: dict[int, CompletionLogprobs] = {}
        echo_lp = req.echo and req.logprobs is not None
        model = self.ctx.model_name
        chunks = StreamChunks(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[]))
        num_prompt_tokens: dict[str, int] = {}
        num_completion_tokens = 0
        try:
            async for out in stream:  # DELTA outputs: only what is new since the previous one
                num_prompt_tokens[out.request_id] = len(out.prompt_token_ids)
                i = index_of[out.request_id]
                if echo_lp and i not in prompt_lps:
                    [first] = first_token_texts(self.ctx, [out])
                    prompt_lps[i] = echo_logprobs(out, first, req.logprobs)
                for c in out.outputs:
                    num_completion_tokens += len(c.token_ids)
                    index = i * req.n + c.index
                    st = states.get(index)
                    if st is None:
                        start = end_offset(prompt_lps[i]) if i in prompt_lps else len(echo_texts[i])
                        st = states[index] = _ChoiceState(text_offset=start)
                    text = c.text if st.started or not echo_texts[i] else echo_texts[i] + c.text
                    want_logprobs = req.logprobs is not None and c.logprobs is not None
                    if not text and c.finish_reason is None and not (want_logprobs and c.token_ids):
                        continue
                    logprobs = None
                    if want_logprobs:
                        logprobs = legacy_logprobs(c.token_ids, c.logprobs, req.logprobs, st.text_offset)
                        if logprobs.text_offset:
                            st.text_offset = end_offset(logprobs)
                        if not st.started and i in prompt_lps:
                            logprobs = joined(prompt_lps[i], logprobs)
                    st.started = True
                    if logprobs is None:
                        yield chunks.text(index, text, c.finish_reason, c.stop_reason)
                        continue
                    yield chunks.event(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                        finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            if req.include_usage:
                prompt_total = sum(num_prompt_tokens.values())
                usage = UsageInfo(prompt_tokens=prompt_total, completion_tokens=num_completion_tokens,
                                  total_tokens=prompt_total + num_completion_tokens)
                yield sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                   usage=usage))
        except Exception as exc:  # noqa: BLE001 (the response has started; report in-band)
            yield OpenAIError.in_band(exc).sse_payload()
        finally:
            stream.close()
        yield SSE_DONE


async def _collect(stream: OutputStream, sub_ids: list[str]) -> list[RequestOutput]:
    latest: dict[str, RequestOutput] = {}
    async for out in stream:
        latest[out.request_id] = out
    return [latest[rid] for rid in sub_ids]
