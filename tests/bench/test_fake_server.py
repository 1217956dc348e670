"""The benchmark against a scripted server: known timings in, the same numbers out; faults reported."""
from __future__ import annotations

import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time

import pytest

from pagedserve.bench import runner
from pagedserve.cli import main
from tests.bench.conftest import bench, read_report, write_jsonl
from tests.bench.fake_server import FakeServer


# No timing slack on a busy 2-core machine: each number is checked against what the server saw on the same
# clock (a client's TTFT cannot be shorter than the server's first-token delay; requests sent one at a time
# lie inside the run one after the other) and against the per-request values it summarizes.


def gaps_slept(monkeypatch) -> list[float]:
    # The arrival gaps the runner sleeps, as it asks for them (the sleeps themselves may overrun).
    gaps, real = [], runner._sleep_unless

    async def recording(stop, seconds):
        gaps.append(seconds)
        await real(stop, seconds)

    monkeypatch.setattr(runner, "_sleep_unless", recording)
    return gaps


def test_known_timings(fake, tmp_path, capsys):
    out = tmp_path / "r.json"
    seen = len(fake.timings)
    rc = main(bench("--base-url", fake.url, "--num-prompts", "4", "--input-len", "8", "--output-len", "5",
                    "--concurrency", "1", "--save-detailed", "--out", str(out)))
    assert rc == 0
    run = read_report(out)["runs"][0]
    m, reqs, server = run["metrics"], run["requests"], fake.timings[seen:]
    assert (run["model"], m["num_completed"], m["num_failed"]) == ("fake-model", 4, 0)
    assert m["total_output_tokens"] == 20 and m["output_tokens_source"] == "usage"
    assert m["total_input_tokens"] == 4 * 8  # the server's usage.prompt_tokens
    assert len(server) == 4 and fake.max_in_flight == 1  # one request at a time
    # ttft 0.1 s, then 4 gaps of 0.02 s: e2e >= 0.18 s. Requests ran one after the other, in server order.
    # asyncio.sleep may wake up to the event loop's clock resolution early (0.09998 s seen for 0.1), so the
    # server's own spans get that much room; the client's times must still cover them exactly.
    early = 0.005
    for r, (received, first, last) in zip(reqs, server):
        assert r["ttft"] >= first - received >= 0.1 - early
        assert r["e2el"] >= last - received >= 0.18 - early
        assert len(r["itls"]) == 4 and r["ttft"] + sum(r["itls"]) <= r["e2el"]
        assert r["tpot"] == pytest.approx((r["e2el"] - r["ttft"]) / 4)
    assert sum(r["e2el"] for r in reqs) <= m["duration_s"]
    for key in ("ttft", "tpot", "e2el"):
        assert m[key]["p50"] == pytest.approx(statistics.median(r[key] for r in reqs))
    assert m["itl"]["p50"] == pytest.approx(statistics.median(g for r in reqs for g in r["itls"]))
    assert m["request_throughput"] == pytest.approx(4 / m["duration_s"])
    assert m["goodput"] == m["request_throughput"]  # no SLO: every completed request counts
    body = fake.bodies[-1]
    assert body["max_tokens"] == 5 and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    text = capsys.readouterr().out
    assert "4 completed, 0 failed" in text and "TTFT" in text


def test_chat_without_usage_counts_chunks(tmp_path):
    srv = FakeServer(ttft_s=0.05, itl_s=0.01, usage=False)
    try:
        out = tmp_path / "r.json"
        assert main(bench("--base-url", srv.url, "--endpoint-type", "chat", "--num-prompts", "3",
                          "--input-len", "4", "--output-len", "6", "--out", str(out))) == 0
    finally:
        srv.close()
    m = read_report(out)["runs"][0]["metrics"]
    assert m["output_tokens_source"] == "chunks" and m["total_output_tokens"] == 18
    assert m["ttft"]["p50"] >= 0.05  # the empty role chunk arrives at once and is not the first token
    assert srv.bodies[-1]["messages"][0]["role"] == "user"


def test_goodput_and_cost_from_slo(fake, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", ["slow one", "quick one", "slow two", "quick two"], 3)
    out = tmp_path / "r.json"
    assert main(bench("--base-url", fake.url, "--dataset", data, "--concurrency", "4", "--slo-ttft", "0.3",
                      "--price-per-hour", "3.6", "--out", str(out))) == 0
    m = read_report(out)["runs"][0]["metrics"]
    assert (m["num_completed"], m["num_good"]) == (4, 2)  # the "slow" prompts wait 0.5 s for a first token
    assert m["goodput"] == pytest.approx(2 / m["duration_s"])
    assert m["cost_per_query"] == pytest.approx(0.001 / m["goodput"])
    assert m["cost_per_million_output_tokens"] == pytest.approx(0.001 / (6 / m["duration_s"]) * 1e6)


def test_poisson_arrivals_follow_the_seeded_gaps(tmp_path, monkeypatch):
    # Open loop: every request is sent on its schedule while the earlier ones still wait for their first token
    # (the server holds them until all 6 have arrived).
    srv, gaps, out = FakeServer(ttft_s=0.1, itl_s=0.02, hold_until=6), gaps_slept(monkeypatch), tmp_path / "r.json"
    try:
        assert main(bench("--base-url", srv.url, "--num-prompts", "6", "--input-len", "4", "--output-len", "2",
                          "--request-rate", "10", "--seed", "3", "--out", str(out))) == 0
    finally:
        srv.close()
    m = read_report(out)["runs"][0]["metrics"]
    rng = random.Random(3)
    assert gaps == [rng.expovariate(10) for _ in range(5)]
    assert srv.max_in_flight == 6 and not srv.hold_timed_out
    assert sum(gaps) + 0.12 <= m["duration_s"]  # the last arrival, then its 0.12 s request


def test_side_by_side_sweep_and_plot(fake, tmp_path, capsys):
    slow = FakeServer(ttft_s=0.2, itl_s=0.04)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    try:
        rc = main(bench("--base-url", fake.url, "--base-url", slow.url, "--label", "fast", "--label", "slow",
                        "--num-prompts", "4", "--input-len", "4", "--output-len", "4", "--concurrency", "1", "2",
                        "--slo-ttft", "0.15", "--price-per-hour", "1", "--out", str(out), "--plot", str(png)))
    finally:
        slow.close()
    assert rc == 0
    report = read_report(out)
    assert [(r["endpoint"], r["concurrency"]) for r in report["runs"]] == [
        ("fast", 1), ("slow", 1), ("fast", 2), ("slow", 2)]
    fast_prompts = [b["prompt"] for b in fake.bodies[-8:]]
    assert len(set(fast_prompts)) == 8  # each sweep point sends fresh words, so no prefix-cache carry-over
    ratio = report["comparisons"][0]["ratios"]["slow"]
    fast_run, slow_run = (r["metrics"] for r in report["runs"][:2])
    # The slow server waits 0.2 s before its first token (noise only adds); the ratio is of the two runs' p50s.
    assert slow_run["ttft"]["p50"] >= 0.2
    assert ratio["TTFT p50"] == pytest.approx(slow_run["ttft"]["p50"] / fast_run["ttft"]["p50"])
    assert ratio["goodput"] == 0.0  # the slow server meets no 0.15 s TTFT target
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "slow / fast" in capsys.readouterr().out


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_unreachable_url_is_reported_and_others_still_run(fake, tmp_path, capsys):
    out, dead = tmp_path / "r.json", _closed_port_url()
    rc = main(bench("--base-url", dead, "--base-url", fake.url, "--num-prompts", "2", "--input-len", "4",
                    "--output-len", "2", "--out", str(out)))
    assert rc == 1
    err = capsys.readouterr().err
    assert f"cannot reach {dead}/v1/models" in err and "skipping this endpoint" in err
    report = read_report(out)
    assert list(report["unreachable"]) == [dead.removeprefix("http://")]
    assert report["runs"][0]["metrics"]["num_completed"] == 2
    assert main(bench("--base-url", dead, "--model", "m", "--num-prompts", "1")) == 1
    assert "no endpoint could be reached" in capsys.readouterr().err


def test_server_errors_keep_partial_results(fake, tmp_path, capsys):
    data = write_jsonl(tmp_path / "p.jsonl", ["a b", "please fail", "c d"], 3)
    out = tmp_path / "r.json"
    assert main(bench("--base-url", fake.url, "--dataset", data, "--out", str(out))) == 0
    m = read_report(out)["runs"][0]["metrics"]
    assert (m["num_completed"], m["num_failed"], m["errors"]) == (2, 1, {"HTTP 500: boom": 1})
    assert "error x1: HTTP 500: boom" in capsys.readouterr().out
    fake.mode = "http_error"
    assert main(bench("--base-url", fake.url, "--dataset", data, "--out", str(out))) == 1  # nothing completed
    assert read_report(out)["runs"][0]["metrics"]["errors"] == {"HTTP 500: boom": 3}


@pytest.mark.parametrize("mode, error", [
    ("malformed", None),
    ("only_malformed", "stream carried no output text (6 malformed SSE lines skipped)"),
    ("error_event", "server error in stream: engine failed"),
    ("truncated", "stream ended without a finish_reason or [DONE]"),
])
def test_bad_streams(fake, tmp_path, capsys, mode, error):
    fake.mode = mode
    out = tmp_path / "r.json"
    main(bench("--base-url", fake.url, "--num-prompts", "2", "--input-len", "4", "--output-len", "3",
               "--out", str(out)))
    m = read_report(out)["runs"][0]["metrics"]
    if error is None:  # garbage lines are skipped, the good chunks around them still count
        assert m["num_completed"] == 2 and m["total_output_tokens"] == 6 and m["malformed_sse_lines"] == 12
        assert "12 malformed SSE lines were skipped" in capsys.readouterr().out
    else:
        assert m["num_completed"] == 0 and m["errors"] == {error: 2}


def test_invalid_dataset_is_a_clear_error(fake, tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text("{oops\n")
    assert main(bench("--base-url", fake.url, "--dataset", str(bad))) == 2
    assert f"error: {bad}:1: not valid JSON" in capsys.readouterr().err
    assert fake.bodies == [] or all("oops" not in str(b) for b in fake.bodies)


def test_ctrl_c_reports_what_finished(tmp_path):
    srv = FakeServer(ttft_s=0.05, itl_s=0.05)  # 0.5 s per request, two at a time: 10 s for all 20
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "pagedserve.cli", *bench("--base-url", srv.url, "--num-prompts", "20",
                                                          "--input-len", "4", "--output-len", "10",
                                                          "--concurrency", "2", "--out", str(out))]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + 60
        while srv.num_finished < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        srv.close()
    assert proc.returncode == 130, stderr
    assert "stopping: cancelling requests in flight" in stderr and "INTERRUPTED" in stdout
    report = read_report(out)
    m = report["runs"][0]["metrics"]
    assert report["interrupted"] and report["runs"][0]["interrupted"]
    assert m["num_completed"] >= 3 and m["num_failed"] == 0
    assert m["num_completed"] + m["num_cancelled"] + m["num_not_sent"] == 20 and m["num_not_sent"] > 0
