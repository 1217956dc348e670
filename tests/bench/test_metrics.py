"""Metric arithmetic on hand-made timings: every reported number is checked exactly."""
from __future__ import annotations

import math

import pytest

from pagedserve.bench.client import RequestResult, chunk_text, error_message, normalize_base_url
from pagedserve.bench.metrics import SLO, compute_metrics, percentiles
from pagedserve.bench.report import format_comparison, format_run, ratios
from pagedserve.bench.runner import RunResult
from pagedserve.bench.client import Endpoint


def result(ttft: float, gaps: list[float], prompt_len: int = 10, source: str = "chunks") -> RequestResult:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestResult(prompt_len=prompt_len, max_tokens=len(times), success=True, ttft=ttft, e2el=times[-1],
                         chunk_times=times, output_tokens=len(times), output_tokens_source=source)


def test_request_derived_latencies():
    r = result(0.5, [0.1, 0.2, 0.3])
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2el == pytest.approx(1.1)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert result(0.5, []).tpot is None  # one token: no decode time


def test_percentiles_interpolate_linearly():
    p = percentiles([1.0, 2.0, 3.0, 4.0])
    assert (p.mean, p.p50, p.p90, p.p99) == pytest.approx((2.5, 2.5, 3.7, 3.97))
    assert percentiles([]) is None


def test_throughput_goodput_and_cost():
    # Four requests of 5 tokens over 2 s; two have a slow first token. One request failed.
    fast = [result(0.1, [0.05] * 4) for _ in range(2)]
    slow = [result(1.0, [0.05] * 4) for _ in range(2)]
    failed = RequestResult(prompt_len=10, max_tokens=5, error="HTTP 500: boom")
    m = compute_metrics(fast + slow + [failed], duration_s=2.0, slo=SLO(ttft_s=0.5, tpot_s=0.1),
                        price_per_hour=3.6)
    assert (m.num_completed, m.num_failed, m.num_good) == (4, 1, 2)
    assert m.request_throughput == pytest.approx(2.0)
    assert m.output_throughput == pytest.approx(10.0)
    assert m.total_token_throughput == pytest.approx(30.0)
    assert m.goodput == pytest.approx(1.0)
    assert m.good_output_throughput == pytest.approx(5.0)
    # $3.6/h = $0.001/s; 1 good query/s -> $0.001 per query; 5 good tokens/s -> $200 per 1M tokens.
    assert m.cost_per_query == pytest.approx(0.001)
    assert m.cost_per_million_output_tokens == pytest.approx(200.0)
    assert m.ttft.p50 == pytest.approx(0.55) and m.ttft.mean == pytest.approx(0.55)
    assert m.tpot.p99 == pytest.approx(0.05) and m.itl.p50 == pytest.approx(0.05)
    assert m.e2el.p50 == pytest.approx(0.75)
    assert m.errors == {"HTTP 500: boom": 1}


def test_tpot_slo_and_no_slo():
    rs = [result(0.1, [0.2] * 3), result(0.1, [0.01] * 3)]
    assert compute_metrics(rs, 1.0, SLO(tpot_s=0.1), None).num_good == 1
    m = compute_metrics(rs, 1.0, SLO(), None)
    assert m.num_good == 2 and m.goodput == m.request_throughput
    assert m.cost_per_query is None  # no price given


def test_cost_is_undefined_when_nothing_meets_the_slo():
    m = compute_metrics([result(2.0, [0.1])], 1.0, SLO(ttft_s=1.0), price_per_hour=2.0)
    assert m.goodput == 0 and m.cost_per_query is None and m.cost_per_million_output_tokens is None
    assert "no request met the SLO" in format_run(_run(), m, SLO(ttft_s=1.0))


def _run() -> RunResult:
    return RunResult(Endpoint("http://x/v1", "m", "x"), math.inf, 4, [], 0, 0, 1.0, False)


def test_side_by_side_ratios():
    a = compute_metrics([result(0.1, [0.05] * 4)], 1.0, SLO(), 1.0)
    b = compute_metrics([result(0.2, [0.1] * 4)] * 2, 1.0, SLO(), 1.0)
    r = ratios(a, b)
    assert r["request throughput"] == pytest.approx(2.0)
    assert r["TTFT p50"] == pytest.approx(2.0) and r["TPOT p50"] == pytest.approx(2.0)
    assert r["cost / query"] == pytest.approx(0.5)
    table = format_comparison(["fast", "slow"], [a, b])
    assert "slow / fast" in table and "2.00x" in table


def test_sse_helpers():
    assert normalize_base_url("http://h:1/") == "http://h:1/v1"
    assert normalize_base_url("http://h:1/v1") == "http://h:1/v1"
    with pytest.raises(ValueError, match="http://"):
        normalize_base_url("h:1")
    assert chunk_text({"choices": [{"text": "a", "finish_reason": None}]}, "completions") == ("a", None)
    assert chunk_text({"choices": [{"delta": {"content": None}, "finish_reason": "stop"}]}, "chat") == ("", "stop")
    assert chunk_text({"choices": "bad"}, "chat") == ("", None)
    assert error_message(b'{"error": {"message": "too long"}}') == "too long"
    assert error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert error_message(b"<html>bad gateway</html>") == "<html>bad gateway</html>"
