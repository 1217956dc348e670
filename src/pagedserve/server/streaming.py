"""Server-sent events and client-disconnect handling shared by the completion and chat endpoints."""
from __future__ import annotations

import asyncio
import logging
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
