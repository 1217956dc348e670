"""raw_http's body reading: chunked (lines split across chunks, chunk extensions), Content-Length, until EOF."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from pagedserve.bench import raw_http


def lines_of(body: bytes, headers: dict[str, str], timeout_s: float = 5.0) -> list[str]:
    async def run() -> list[str]:
        reader = asyncio.StreamReader()
        reader.feed_data(body)
        reader.feed_eof()
        resp = raw_http.RawResponse(reader, 200, headers, timeout_s)
        return [line async for line in resp.aiter_lines()]

    return asyncio.run(run())


def chunked(*pieces: bytes) -> bytes:
    # The first chunk's size line carries an extension, which readers must skip.
    out = b"".join(b"%x%s\r\n%s\r\n" % (len(p), b";ext=1" if i == 0 else b"", p) for i, p in enumerate(pieces))
    return out + b"0\r\n\r\n"


def test_chunked_lines_split_across_chunks():
    body = chunked(b"data: {", b'"a":1', b"}\r\n\r\ndata:", b" [DONE]\n\n")
    assert lines_of(body, {"transfer-encoding": "chunked"}) == ['data: {"a":1}', "", "data: [DONE]", ""]


def test_content_length_and_eof_bodies():
    assert lines_of(b'{"error": "x"}', {"content-length": "14"}) == ['{"error": "x"}']
    assert lines_of(b"data: 1\ndata: 2", {}) == ["data: 1", "data: 2"]


def test_a_body_cut_short_is_a_protocol_error():
    with pytest.raises(httpx.RemoteProtocolError):
        lines_of(b"10\r\ndata: short", {"transfer-encoding": "chunked"})


def test_only_plain_http_without_a_proxy(monkeypatch):
    for k in raw_http.PROXY_VARIABLES:
        monkeypatch.delenv(k, raising=False)
    assert raw_http.usable("http://127.0.0.1:8000/v1/completions")
    assert not raw_http.usable("https://example.com/v1/completions")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert not raw_http.usable("http://127.0.0.1:8000/v1/completions")
