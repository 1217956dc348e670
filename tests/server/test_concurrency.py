"""Many streams at once, and clients that walk away: afterwards the KV pool must be entirely free."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server.helpers import metric, scrape, wait_pool_free

NUM_STREAMS = 100


def test_100_concurrent_streams(server, model_name):
    lengths = [3 + i % 6 for i in range(NUM_STREAMS)]  # 3..8 tokens, so every stream has its own target

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str, str, int]:
        stream = await client.completions.create(
            model=model_name, prompt=f"Request number {i} says", max_tokens=lengths[i], temperature=0.8,
            seed=i, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, reason, usage = "", None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
        return i, text, reason, usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_STREAMS)), return_exceptions=True)

    before = scrape(server.url)
    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures[:3]
    for i, text, reason, completion_tokens in results:
        assert reason == "length", i
        assert completion_tokens == lengths[i], i
    wait_pool_free(server.url, timeout=5.0)
    after = scrape(server.url)
    generated = (metric(after, "pagedserve:generation_tokens_total")
                 - metric(before, "pagedserve:generation_tokens_total"))
    assert generated >= sum(lengths)  # preemption may recompute, never lose, tokens
    finished = (metric(after, "pagedserve:request_success_total", finished_reason="length")
                - metric(before, "pagedserve:request_success_total", finished_reason="length"))
    assert finished == NUM_STREAMS
    print(f"{NUM_STREAMS} streams in {elapsed:.1f}s")


def test_disconnected_stream_frees_its_blocks(server, model_name):
    before = scrape(server.url)
    body = {"model": model_name, "prompt": "Write a very long story about a dragon.", "max_tokens": 1000,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data: {"):
                    seen += 1
                if seen == 3:
                    break
            running = scrape(server.url)
            assert metric(running, "pagedserve:num_requests_running") == 1
            assert metric(running, "pagedserve:kv_cache_usage_perc") > 0
        # Leaving the block closes the connection mid-stream: 1000 tokens would take far longer than this.
    took = wait_pool_free(server.url, timeout=5.0)
    assert took < 1.0, f"blocks freed {took:.2f}s after the disconnect"
    after = scrape(server.url)
    aborted = (metric(after, "pagedserve:request_success_total", finished_reason="abort")
               - metric(before, "pagedserve:request_success_total", finished_reason="abort"))
    assert aborted == 1


def test_disconnected_non_streaming_request_is_aborted(server, model_name):
    before = scrape(server.url)
    body = {"model": model_name, "prompt": "Write a very long story about a knight.", "max_tokens": 1000,
            "ignore_eos": True}
    try:
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.5)
    except httpx.TimeoutException:
        pass
    else:
        pytest.skip("1000 tokens finished within 1.5 s; nothing was left to abort")
    wait_pool_free(server.url, timeout=2.0)
    after = scrape(server.url)
    assert (metric(after, "pagedserve:request_success_total", finished_reason="abort")
            - metric(before, "pagedserve:request_success_total", finished_reason="abort")) == 1
