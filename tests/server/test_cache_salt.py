"""cache_salt over HTTP: another tenant's cached prefix shows no hit in /metrics; the same tenant's does."""
from __future__ import annotations

import time

import openai
import pytest

from tests.server.helpers import metric, scrape

PROMPT = ("Tenant isolation check: " + " ".join(f"item{i}" for i in range(40)) + ". Summarize the list.")
QUERIES = "pagedserve:prefix_cache_queries_total"
HITS = "pagedserve:prefix_cache_hits_total"


class PrefixCounter:
    """Prefix-cache hits of each request, read from /metrics once its prompt tokens are counted."""

    def __init__(self, url: str) -> None:
        self.url = url
        s = scrape(url)
        self.queries, self.hits = metric(s, QUERIES), metric(s, HITS)

    def hits_of(self, num_prompt_tokens: int, timeout: float = 10.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            s = scrape(self.url)
            if metric(s, QUERIES) >= self.queries + num_prompt_tokens or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert metric(s, QUERIES) == self.queries + num_prompt_tokens
        hits = metric(s, HITS) - self.hits
        self.queries, self.hits = metric(s, QUERIES), metric(s, HITS)
        return hits


def test_completions_share_only_within_a_salt(server, client, model_name):
    counter = PrefixCounter(server.url)

    def hits(salt: str | None) -> float:
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, temperature=0,
                                      extra_body=extra)
        assert r.usage.prompt_tokens > 32
        return counter.hits_of(r.usage.prompt_tokens)

    assert hits("tenant-a") == 0
    assert hits("tenant-b") == 0
    assert hits(None) == 0
    assert hits("tenant-a") >= 32
    assert hits(None) >= 32


def test_chat_shares_only_within_a_salt(server, client, model_name):
    counter = PrefixCounter(server.url)
    messages = [{"role": "user", "content": "Chat " + PROMPT}]

    def hits(salt: str) -> float:
        r = client.chat.completions.create(model=model_name, messages=messages, max_tokens=2, temperature=0,
                                           extra_body={"cache_salt": salt})
        assert r.usage.prompt_tokens > 32
        return counter.hits_of(r.usage.prompt_tokens)

    assert hits("tenant-a") == 0
    assert hits("tenant-b") == 0
    assert hits("tenant-a") >= 32


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_empty_salt_is_a_400(client, model_name, endpoint):
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        if endpoint == "completions":
            client.completions.create(model=model_name, prompt="hi", max_tokens=1, extra_body={"cache_salt": ""})
        else:
            client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=1, extra_body={"cache_salt": ""})
