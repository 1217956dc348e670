"""`priority` over HTTP: a 400 unless --scheduling-policy priority; with it, an urgent request preempts the
running one and finishes before those queued ahead of it; latency series per priority class. Fairness between
client requests: a one-prompt request is not held behind a many-prompt one."""
from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.server.helpers import ServerProcess, metric, scrape
from tests.server.test_errors import assert_openai_error


@pytest.fixture(scope="module")
def priority_server():
    srv = ServerProcess("--scheduling-policy", "priority", "--max-num-seqs", "1")
    yield srv
    srv.close()


def complete(server, prompt: str, max_tokens: int, priority: int) -> float:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "priority": priority}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return time.monotonic()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "priority": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "priority": -1}),
])
def test_priority_without_the_policy_is_400(server, path, body):
    for route in (path, f"{path}/render"):
        err = assert_openai_error(httpx.post(f"{server.url}{route}", json=body, timeout=60), 400)
        assert "priority scheduling is not enabled" in err["message"] and err["param"] == "priority"
    body["priority"] = 0  # vLLM's default is always accepted
    assert httpx.post(f"{server.url}{path}", json=body, timeout=60).status_code == 200


def test_urgent_request_overtakes_the_queue(priority_server):
    url = priority_server.url
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        lows = [pool.submit(complete, priority_server, f"low {i}", 64, 5) for i in range(3)]
        deadline = time.monotonic() + 120
        while metric(scrape(url), "pagedserve:num_requests_waiting") < 2:  # one runs, two wait
            assert time.monotonic() < deadline
            time.sleep(0.02)
        high = pool.submit(complete, priority_server, "high", 4, -3)
        # One slot: the urgent request preempts the running one and is done before any low one.
        assert high.result() < min(f.result() for f in lows)
    s = scrape(url)
    assert metric(s, "pagedserve:num_preemptions_total") >= 1
    counts = {p: metric(s, "pagedserve:time_to_first_token_by_priority_seconds_count", priority=p)
              for p in ("5", "-3")}
    assert counts == {"5": 3, "-3": 1}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "priority": 100}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    # Labels are clamped to -8..8.
    assert metric(scrape(url), "pagedserve:e2e_request_latency_by_priority_seconds_count", priority="8") == 1


def test_a_many_prompt_request_does_not_hold_a_later_one(priority_server):
    # One slot. 48 prompts in one request, then one prompt: it is admitted between the big request's prompts
    # (fair between client requests, whatever the policy), so it is done long before the big one. A request
    # arriving k steps late waits behind about k of the big one's sequences: 48 leave room for a slow client.
    url = priority_server.url

    def big() -> float:
        body = {"prompt": [f"item {i}" for i in range(48)], "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=300).status_code == 200
        return time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        many = pool.submit(big)
        deadline = time.monotonic() + 120
        while metric(scrape(url), "pagedserve:num_requests_waiting") < 8:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        single = pool.submit(complete, priority_server, "alone", 8, 0)
        assert single.result() < many.result()
        assert metric(scrape(url), "pagedserve:num_requests_waiting") == 0
