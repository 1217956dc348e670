"""The benchmark against a real `pagedserve serve`: a handful of short requests, cross-checked with the
server's own Prometheus counters."""
from __future__ import annotations

import pytest

from pagedserve.cli import main
from tests.bench.conftest import bench, read_report
from tests.server.helpers import ServerProcess, metric, scrape


@pytest.fixture(scope="module")
def live():
    srv = ServerProcess()
    yield srv
    srv.close()


def test_completions_against_pagedserve(live, tmp_path):
    before = scrape(live.url)
    out = tmp_path / "r.json"
    rc = main(bench("--base-url", live.url, "--num-prompts", "4", "--input-len", "12", "--output-len", "6",
                    "--concurrency", "2", "--slo-ttft", "60", "--price-per-hour", "1", "--save-detailed",
                    "--out", str(out)))
    assert rc == 0
    run = read_report(out)["runs"][0]
    m = run["metrics"]
    assert (m["num_completed"], m["num_failed"], m["output_tokens_source"]) == (4, 0, "usage")
    assert m["total_output_tokens"] == 24  # ignore_eos: exactly max_tokens each
    assert m["total_input_tokens"] == 48   # every benchmark word is one SmolLM2 token
    for r in run["requests"]:
        # pagedserve streams one token per chunk, so the chunk gaps are the per-token gaps.
        assert len(r["itls"]) == r["output_tokens"] - 1 == 5
        assert 0 < r["ttft"] < r["e2el"]
    assert m["num_good"] == 4 and m["cost_per_query"] == pytest.approx(1 / 3600 / m["goodput"])
    after = scrape(live.url)
    gen = "pagedserve:generation_tokens_total"
    assert metric(after, gen) - metric(before, gen) == 24


def test_chat_against_pagedserve(live, tmp_path):
    out = tmp_path / "r.json"
    assert main(bench("--base-url", live.url, "--endpoint-type", "chat", "--num-prompts", "2",
                      "--input-len", "8", "--output-len", "4", "--out", str(out))) == 0
    m = read_report(out)["runs"][0]["metrics"]
    assert (m["num_completed"], m["total_output_tokens"]) == (2, 8)
    assert m["ttft"]["p50"] > 0 and m["tpot"]["p50"] > 0
