"""Text and JSON reports: one block per run, a side-by-side table with ratios when several endpoints ran."""
from __future__ import annotations

import json
import math
import os

from pagedserve.bench.metrics import SLO, Metrics, Percentiles
from pagedserve.bench.runner import RunResult

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))
# (label, getter, unit, higher_is_better) for the side-by-side table and its ratios.
COMPARED = (
    ("request throughput", lambda m: m.request_throughput, "req/s", True),
    ("output throughput", lambda m: m.output_throughput, "tok/s", True),
    ("goodput", lambda m: m.goodput, "req/s", True),
    ("TTFT p50", lambda m: m.ttft and m.ttft.p50 * 1e3, "ms", False),
    ("TTFT p99", lambda m: m.ttft and m.ttft.p99 * 1e3, "ms", False),
    ("TPOT p50", lambda m: m.tpot and m.tpot.p50 * 1e3, "ms", False),
    ("TPOT p99", lambda m: m.tpot and m.tpot.p99 * 1e3, "ms", False),
    ("ITL p50", lambda m: m.itl and m.itl.p50 * 1e3, "ms", False),
    ("E2E p50", lambda m: m.e2el and m.e2el.p50 * 1e3, "ms", False),
    ("E2E p99", lambda m: m.e2el and m.e2el.p99 * 1e3, "ms", False),
    ("cost / query", lambda m: m.cost_per_query, "USD", False),
    ("cost / 1M out tok", lambda m: m.cost_per_million_output_tokens, "USD", False),
)


def load_label(rate: float, concurrency: int | None) -> str:
    r = "inf" if math.isinf(rate) else f"{rate:g}/s"
    return f"rate {r}" + (f", concurrency {concurrency}" if concurrency else "")


def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    if x != 0 and abs(x) < 10 ** -digits:
        return f"{x:.{digits}e}"
    return f"{x:,.{digits}f}"


def format_run(run: RunResult, m: Metrics, slo: SLO) -> str:
    ep = run.endpoint
    lines = [f"== {ep.label} ({ep.base_url}, model {ep.model}, {ep.api}) | {load_label(run.request_rate, run.concurrency)}"
             + (" | INTERRUPTED" if run.interrupted else "") + " =="]
    lines.append(f"requests      {m.num_completed} completed, {m.num_failed} failed"
                 + (f", {m.num_cancelled} cancelled" if m.num_cancelled else "")
                 + (f", {m.num_not_sent} not sent" if m.num_not_sent else "") + f" in {m.duration_s:.2f} s")
    lines.append(f"tokens        {m.total_input_tokens} prompt, {m.total_output_tokens} output "
                 f"(output counted from {m.output_tokens_source})")
    lines.append(f"throughput    {_fmt(m.request_throughput)} req/s, {_fmt(m.output_throughput, 1)} output tok/s, "
                 f"{_fmt(m.total_token_throughput, 1)} total tok/s")
    lines.append(f"goodput       {_fmt(m.goodput)} req/s ({m.num_good}/{m.num_completed} met SLO: {slo.describe()})")
    if m.price_per_hour is not None:
        lines.append(f"cost @ ${m.price_per_hour:g}/h  ${_fmt(m.cost_per_query, 6)} per query, "
                     f"${_fmt(m.cost_per_million_output_tokens)} per 1M output tokens"
                     + ("  (no request met the SLO)" if m.num_good == 0 else ""))
    lines.append(f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key, name in LATENCIES:
        p: Percentiles | None = getattr(m, key)
        vals = [p.mean, p.p50, p.p90, p.p99] if p else [None] * 4
        lines.append(f"  {name:<12}" + "".join(f"{_fmt(v and v * 1e3, 1):>10}" for v in vals))
    if m.malformed_sse_lines:
        lines.append(f"warning: {m.malformed_sse_lines} malformed SSE lines were skipped")
    for msg, n in list(m.errors.items())[:5]:
        lines.append(f"error x{n}: {msg}")
    if len(m.errors) > 5:
        lines.append(f"... and {len(m.errors) - 5} more distinct errors (see the JSON report)")
    return "\n".join(lines)


def ratios(base: Metrics, other: Metrics) -> dict[str, float | None]:
    # other / base for every compared metric; None where either side has no value.
    out = {}
    for name, get, _, _ in COMPARED:
        a, b = get(base), get(other)
        out[name] = b / a if a and b is not None else None
    return out


def format_comparison(labels: list[str], metrics: list[Metrics]) -> str:
    width = max(14, *(len(x) + 2 for x in labels))
    head = f"{'metric':<28}" + "".join(f"{x:>{width}}" for x in labels)
    head += "".join(f"{x + ' / ' + labels[0]:>{max(width, len(x) + len(labels[0]) + 5)}}" for x in labels[1:])
    lines = [head]
    for name, get, unit, _ in COMPARED:
        row = f"{name + ' (' + unit + ')':<28}"
        row += "".join(f"{_fmt(get(m), 6 if name == 'cost / query' else 2):>{width}}" for m in metrics)
        for label, m in zip(labels[1:], metrics[1:]):
            r = ratios(metrics[0], m)[name]
            row += f"{(_fmt(r) + 'x') if r is not None else 'n/a':>{max(width, len(label) + len(labels[0]) + 5)}}"
        lines.append(row)
    lines.append("(ratios are other / first: above 1 is better for throughput and goodput, worse for latency and cost)")
    return "\n".join(lines)


def run_to_dict(run: RunResult, m: Metrics, detailed: bool = False) -> dict:
    ep = run.endpoint
    d = {"endpoint": ep.label, "base_url": ep.base_url, "model": ep.model, "api": ep.api,
         "request_rate": "inf" if math.isinf(run.request_rate) else run.request_rate,
         "concurrency": run.concurrency, "interrupted": run.interrupted, "metrics": m.to_dict()}
    if detailed:
        d["requests"] = [{"success": r.success, "error": r.error, "prompt_len": r.prompt_len,
                          "max_tokens": r.max_tokens, "output_tokens": r.output_tokens, "ttft": r.ttft,
                          "tpot": r.tpot, "e2el": r.e2el, "itls": r.itls, "finish_reason": r.finish_reason}
                         for r in run.results]
    return d


def write_json(path: str, data: dict) -> None:
    # Written to a temporary name and renamed, so an interrupted write never leaves half a report.
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
