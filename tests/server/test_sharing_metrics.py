"""Sharing shows in /metrics: prefix-cache hits for a shared system prompt, copy-on-write for n > 1."""
from __future__ import annotations

from tests.server.helpers import metric, scrape

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
    assert metric(after, "pagedserve:preemptions_by_mode_total", mode="swap") == 0
