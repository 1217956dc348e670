"""Server-sent events and client-disconnect handling shared by the completion and chat endpoints."""
from __future__ import annotations

import asyncio
import json
import logging
from json.encoder import encode_basestring
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.messages import describe_error
from pagedserve.server.errors import OpenAIError

logger = logging.getLogger(__name__)
T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def _json(value: str | int | None) -> str:
    # A string, an integer or null, as pydantic writes it (UTF-8 kept, control characters escaped): what
    # json.dumps(value, ensure_ascii=False) gives, without its per-call encoder set-up.
    if value is None:
        return "null"
    if isinstance(value, str):
        return encode_basestring(value)
    return json.dumps(value)


class StreamChunks:
    """The SSE events of one stream's chunks, written without building a pydantic model per token.

    A streamed token is one chunk per client, so its serialization is paid per token per stream on the event loop
    (about 14 us through CompletionStreamResponse(...).model_dump_json(), 3 us here). Around the choices, a
    stream's chunks are all alike (id, object, created, model, usage null), so that frame is written once from the
    response model given with choices=[]; a plain text choice (no logprobs, no tool calls) is written from its
    fields in the choice model's field order. Anything else goes through the model. test_streaming.py checks the
    bytes equal model_dump_json's.
    """

    def __init__(self, frame: BaseModel) -> None:
        head, found, tail = frame.model_dump_json().partition('"choices":[]')
        if not found:
            raise ValueError(f"{type(frame).__name__} has no empty choices list to fill")
        self._head = f'data: {head}"choices":['
        self._tail = f"]{tail}\n\n"

    def event(self, choice: BaseModel) -> str:
        return f"{self._head}{choice.model_dump_json()}{self._tail}"

    def text(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
        # CompletionChoice(index, text, finish_reason, stop_reason), logprobs and prompt_logprobs null.
        return (f'{self._head}{{"index":{index},"text":{_json(text)},"logprobs":null,"finish_reason":'
                f'{_json(finish_reason)},"stop_reason":{_json(stop_reason)},"prompt_logprobs":null}}{self._tail}')

    def content(self, index: int, content: str | None, finish_reason: str | None, stop_reason: int | str | None) -> str:
        # ChatStreamChoice(index, DeltaMessage(content=content), finish_reason, stop_reason), logprobs null.
        return (f'{self._head}{{"index":{index},"delta":{{"role":null,"content":{_json(content)},'
                f'"reasoning_content":null,"tool_calls":null}},"logprobs":null,"finish_reason":'
                f'{_json(finish_reason)},"stop_reason":{_json(stop_reason)}}}{self._tail}')


def json_response(payload: BaseModel, status_code: int = 200) -> Response:
    # pydantic's serializer writes a non-finite float (a -inf logprob) as null, where json.dumps would emit
    # the invalid token -Infinity.
    return Response(payload.model_dump_json(), status_code=status_code, media_type="application/json")


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs on_close however it ends.

    Starlette cancels the body iterator when the client disconnects, and the iterator's own cleanup aborts
    its requests; on_close covers the case where the iterator never started (a disconnect before the first
    chunk), which would otherwise leave the requests generating for nobody.
    """
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(_ended_properly(content),
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _ended_properly(content: AsyncIterator[str]) -> AsyncIterator[str]:
    # Once the 200 and the first events are out, an exception can no longer become an error response, and
    # letting it escape cuts the connection without [DONE]. The endpoints report engine errors in-band
    # themselves; this covers any bug they do not.
    try:
        async for chunk in content:
            yield chunk
    except Exception as exc:  # noqa: BLE001
        logger.exception("a streaming response failed")
        yield OpenAIError(f"internal server error: {describe_error(exc)}", 500).sse_payload()
        yield SSE_DONE


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is http.disconnect, sent when the client goes away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await work for a non-streaming response, cancelling it (and so aborting its requests) if the client
    disconnects first."""
    task: asyncio.Future[Any] = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
