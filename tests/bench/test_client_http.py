"""The bench client's HTTP: SSE lines however the bytes arrive, a read timeout, an unreachable server."""
from __future__ import annotations

import asyncio

from pagedserve.bench.client import Endpoint, lines, send_request
from pagedserve.bench.dataset import BenchRequest
from pagedserve.bench.runner import make_client
from tests.bench.fake_server import FakeServer


def lines_of(*chunks: bytes) -> list[str]:
    async def gen():
        for c in chunks:
            yield c

    async def run():
        return [line async for line in lines(gen())]

    return asyncio.run(run())


def test_lines_split_across_reads():
    assert lines_of(b"data: {", b'"a":1', b"}\r\n\r\ndata:", b" [DONE]\n\n") == [
        'data: {"a":1}', "", "data: [DONE]", ""]
    assert lines_of(b"data: 1\ndata: 2") == ["data: 1", "data: 2"]  # the last line needs no newline
    big = b"x" * 300_000  # longer than aiohttp's readline limit (64 KiB): no limit here
    assert lines_of(b"data: ", big[:100_000], big[100_000:], b"\n") == ["data: " + big.decode()]


def test_read_timeout_and_unreachable_server():
    srv = FakeServer(ttft_s=0.01, itl_s=0.001, slow_ttft_s=3.0)

    async def run():
        async with make_client(None, timeout_s=0.5) as client:
            ep = Endpoint(f"{srv.url}/v1", "fake-model", "fake")
            ok = await send_request(client, ep, BenchRequest("fine", 1, 3), {})
            slow = await send_request(client, ep, BenchRequest("slow", 1, 3), {})  # no byte for 3 s
            dead = await send_request(client, Endpoint("http://127.0.0.1:9/v1", "m", "dead"),
                                      BenchRequest("x", 1, 3), {})
        return ok, slow, dead

    try:
        ok, slow, dead = asyncio.run(run())
    finally:
        srv.close()
    assert ok.success and ok.output_tokens == 3 and len(ok.chunk_times) == 3
    assert not slow.success and slow.error.startswith("timed out") and 0.5 <= slow.e2el < 3.0
    assert not dead.success and dead.error.startswith("cannot connect to http://127.0.0.1:9/v1/completions")
