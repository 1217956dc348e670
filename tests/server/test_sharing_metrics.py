"""/metrics: sharing (prefix-cache hits, copy-on-write for n > 1) and per-request counting and timing."""
from __future__ import annotations

import httpx

from tests.server.helpers import metric, scrape, wait_pool_free

SYSTEM = ("You are the assistant of an analytics product. Answer questions about dashboards, metrics and "
          "reports briefly and precisely, and never invent numbers that are not in the data. ")


def test_shared_prefix_and_parallel_samples_are_visible(server, client, model_name):
    before = scrape(server.url)
    for q in ("How many users signed up?", "What was revenue last week?"):
        client.completions.create(model=model_name, prompt=SYSTEM + q, max_tokens=2, temperature=0)
    client.completions.create(model=model_name, prompt="Once upon a time, a", max_tokens=3, n=3, seed=5)
    after = scrape(server.url)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert delta("pagedserve:prefix_cache_hits_total") >= 16      # the second question reuses the system prompt
    assert delta("pagedserve:prefix_cache_queries_total") > delta("pagedserve:prefix_cache_hits_total")
    assert delta("pagedserve:kv_copy_on_write_total") == 2         # samples 2 and 3 copy the partial block
    assert metric(after, "pagedserve:kv_shared_blocks") == 0
    # The KV element type and its bytes per token (2 x 30 layers x 3 KV heads x 64 x 4 B) in the cache info.
    assert metric(after, "pagedserve:cache_config_info", cache_dtype="float32", kv_bytes_per_token="46080") == 1
    assert "float32, 46080 bytes per token" in server.read_log()


def test_requests_count_once_and_queue_time_ends_before_the_first_token(server, client, model_name):
    p = "pagedserve"
    before = scrape(server.url)
    client.completions.create(model=model_name, prompt="Count to ten:", max_tokens=3, n=3, seed=1,
                              extra_body={"ignore_eos": True})
    # Scraped right after the response: the engine's snapshot is taken before it dispatches outputs.
    done = scrape(server.url)
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": "Tell a long story", "max_tokens": 500, "n": 3, "stream": True,
                            "ignore_eos": True}) as resp:
        next(line for line in resp.iter_lines() if line)  # then disconnect: the request is aborted
    wait_pool_free(server.url)
    after = scrape(server.url)

    def delta(a: dict, b: dict, name: str, **labels: str) -> float:
        return metric(b, f"{p}:{name}", **labels) - metric(a, f"{p}:{name}", **labels)

    # One request of three samples is one finished request, and one aborted request.
    assert delta(before, done, "request_success_total", finished_reason="length") == 1
    assert delta(done, after, "request_success_total", finished_reason="abort") == 1
    assert delta(before, done, "e2e_request_latency_seconds_count") == 1
    assert delta(before, done, "inter_token_latency_seconds_count") == 3 * 2  # two gaps per sample
    # Queue time ends when the scheduler admits the request, before its prefill runs: less than TTFT.
    queue = delta(before, done, "request_queue_time_seconds_sum")
    ttft = delta(before, done, "time_to_first_token_seconds_sum")
    assert 0 <= queue < ttft, (queue, ttft)
