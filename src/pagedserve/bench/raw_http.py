"""A lean HTTP/1.1 POST whose response body is read as it streams, for plain http:// endpoints.

The benchmark client usually runs on the machine it measures. Through httpx (httpcore, h11, anyio) reading one
streamed SSE event cost ~100 us of client CPU on a 2-core EPYC, about as much as the server spends on it, and
that CPU is taken from the server being measured. Here one event is a chunk read off an asyncio StreamReader
(~10 us); vLLM's benchmark client uses aiohttp for the same reason. https:// and anything this does not parse
(no chunked or Content-Length body) stay with httpx.

Errors are mapped to the httpx exceptions the caller already handles: ConnectError, ReadTimeout (no byte for
timeout_s, like httpx's read timeout), RemoteProtocolError.
"""
from __future__ import annotations

import asyncio
import json
import os
from typing import AsyncIterator
from urllib.parse import urlsplit

import httpx


PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY")


class RawResponse:
    def __init__(self, reader: asyncio.StreamReader, status_code: int, headers: dict[str, str],
                 timeout_s: float) -> None:
        self.reader, self.status_code, self.headers, self.timeout_s = reader, status_code, headers, timeout_s

    async def _read(self, op) -> bytes:
        try:
            async with asyncio.timeout(self.timeout_s):  # a timer handle, not a task per read as wait_for makes
                return await op
        except TimeoutError as e:
            raise httpx.ReadTimeout(f"no data for {self.timeout_s:g} s") from e
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as e:
            raise httpx.RemoteProtocolError(f"the connection broke mid-body: {type(e).__name__}") from e

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self._read(self.reader.readuntil(b"\r\n"))).split(b";")[0], 16)
                data = await self._read(self.reader.readexactly(size + 2))
                if size == 0:
                    return
                yield data[:-2]
        elif "content-length" in self.headers:
            yield await self._read(self.reader.readexactly(int(self.headers["content-length"])))
        else:  # the body ends when the server closes the connection
            while data := await self._read(self.reader.read(65536)):
                yield data

    async def aiter_lines(self) -> AsyncIterator[str]:
        pending = b""
        async for data in self.aiter_bytes():
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if pending:
            yield pending.decode("utf-8", errors="replace")

    async def aread(self) -> bytes:
        return b"".join([data async for data in self.aiter_bytes()])


def usable(url: str) -> bool:
    # A proxy in the environment is httpx's to honour.
    return url.startswith("http://") and not any(os.environ.get(k) for k in PROXY_VARIABLES)


async def open_stream(url: str, body: dict, headers: dict[str, str], timeout_s: float
                      ) -> tuple[RawResponse, asyncio.StreamWriter]:
    """Sends the POST and reads the status line and headers; the caller closes the writer."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10.0)
    except (OSError, TimeoutError) as e:
        raise httpx.ConnectError(f"{type(e).__name__}: {e}") from e
    try:
        payload = json.dumps(body).encode()
        lines = [f"POST {parts.path or '/'}{'?' + parts.query if parts.query else ''} HTTP/1.1",
                 f"Host: {parts.netloc}", "Content-Type: application/json", f"Content-Length: {len(payload)}",
                 "Accept: text/event-stream", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload)
        response = RawResponse(reader, 0, {}, timeout_s)
        head = await response._read(reader.readuntil(b"\r\n\r\n"))
        status, *fields = head.decode("latin-1").split("\r\n")
        try:
            response.status_code = int(status.split(" ", 2)[1])
        except (IndexError, ValueError) as e:
            raise httpx.RemoteProtocolError(f"not an HTTP status line: {status[:80]!r}") from e
        for field in fields:
            name, sep, value = field.partition(":")
            if sep:
                response.headers[name.strip().lower()] = value.strip()
        return response, writer
    except BaseException:
        writer.close()
        raise
