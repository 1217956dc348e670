"""Benchmark metrics from timed requests: throughput, latency percentiles, goodput and cost.

Throughputs divide by the run's wall time (first request sent to last one finished, or to Ctrl-C) and
count completed requests only. Goodput counts the completed requests that met every SLO given (all of them
when none is). Cost comes from goodput, because a request that missed its SLO is not a query the user can sell:

    cost per query            = price_per_hour / 3600 / goodput
    cost per 1M output tokens = price_per_hour / 3600 / (output tokens of good requests per second) * 1e6
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from pagedserve.bench.client import RequestResult


@dataclass(slots=True)
class Percentiles:
    mean: float
    p50: float
    p90: float
    p99: float


def percentiles(values: list[float]) -> Percentiles | None:
    # Linear interpolation between order statistics (numpy's default), as vLLM's benchmark reports them.
    if not values:
        return None
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=float), [50, 90, 99]).tolist()
    return Percentiles(float(np.mean(values)), p50, p90, p99)


GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2el_s: float | None = None

    @property
    def is_empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None and self.e2el_s is None

    def met(self, r: RequestResult) -> bool:
        # A one-token answer has no TPOT and so cannot miss a TPOT target.
        if not r.success:
            return False
        if self.ttft_s is not None and (r.ttft is None or r.ttft > self.ttft_s):
            return False
        if self.tpot_s is not None and r.tpot is not None and r.tpot > self.tpot_s:
            return False
        return self.e2el_s is None or (r.e2el is not None and r.e2el <= self.e2el_s)

    @classmethod
    def parse_goodput(cls, items: list[str]) -> "SLO":
        # vLLM's --goodput: KEY:MILLISECONDS pairs, keys ttft, tpot and e2el.
        values: dict[str, float] = {}
        for item in items:
            key, _, ms = item.partition(":")
            if key not in GOODPUT_KEYS:
                raise ValueError(f"--goodput takes {', '.join(k + ':MS' for k in GOODPUT_KEYS)}, got {item!r}")
            try:
                value = float(ms)
            except ValueError:
                value = -1.0
            if not value > 0:
                raise ValueError(f"--goodput {key} needs a positive number of milliseconds, got {item!r}")
            values[f"{key}_s"] = value / 1e3
        return cls(**values)

    def describe(self) -> str:
        parts = [f"{n}<={v:g}s" for n, v in (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("e2e", self.e2el_s))
                 if v is not None]
        return ", ".join(parts) or "none"


@dataclass(slots=True)
class Metrics:
    num_completed: int
    num_failed: int
    num_cancelled: int                # in flight when the run was stopped; not counted anywhere else
    num_not_sent: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float         # completed requests / s
    output_throughput: float          # output tokens / s
    total_token_throughput: float     # (prompt + output tokens) / s
    ttft: Percentiles | None          # seconds
    tpot: Percentiles | None
    itl: Percentiles | None
    e2el: Percentiles | None
    num_good: int
    slo_attainment: float             # share of the requests sent (failed ones too) that met every SLO
    goodput: float                    # requests / s that met every SLO
    good_output_throughput: float
    price_per_hour: float | None
    cost_per_query: float | None      # USD; None without a price or when nothing met the SLO
    cost_per_million_output_tokens: float | None
    output_tokens_source: str         # "usage", "chunks" or "mixed"
    malformed_sse_lines: int
    errors: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def compute_metrics(results: list[RequestResult], duration_s: float, slo: SLO, price_per_hour: float | None,
                    num_cancelled: int = 0, num_not_sent: int = 0) -> Metrics:
    ok = [r for r in results if r.success]
    good = [r for r in ok if slo.met(r)]
    dur = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    goodput = len(good) / dur
    good_tok_s = sum(r.output_tokens for r in good) / dur
    per_s = price_per_hour / 3600 if price_per_hour is not None else None
    sources = {r.output_tokens_source for r in ok}
    return Metrics(
        num_completed=len(ok), num_failed=len(results) - len(ok), num_cancelled=num_cancelled,
        num_not_sent=num_not_sent, duration_s=duration_s,
        total_input_tokens=in_tokens, total_output_tokens=out_tokens,
        request_throughput=len(ok) / dur, output_throughput=out_tokens / dur,
        total_token_throughput=(in_tokens + out_tokens) / dur,
        ttft=percentiles([r.ttft for r in ok if r.ttft is not None]),
        tpot=percentiles([t for r in ok if (t := r.tpot) is not None]),
        itl=percentiles([g for r in ok for g in r.itls]),
        e2el=percentiles([r.e2el for r in ok if r.e2el is not None]),
        num_good=len(good), slo_attainment=len(good) / max(len(results), 1), goodput=goodput, good_output_throughput=good_tok_s, price_per_hour=price_per_hour,
        cost_per_query=per_s / goodput if per_s is not None and goodput > 0 else None,
        cost_per_million_output_tokens=per_s / good_tok_s * 1e6 if per_s is not None and good_tok_s > 0 else None,
        output_tokens_source=sources.pop() if len(sources) == 1 else ("mixed" if sources else "none"),
        malformed_sse_lines=sum(r.malformed_lines for r in results),
        errors=dict(Counter(r.error for r in results if r.error).most_common()),
    )
