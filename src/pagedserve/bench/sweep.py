"""`pagedserve bench serve --sweep`: the highest request rate at which enough requests meet the SLO.

Goodput as DistServe defines it: the largest arrival rate a deployment sustains while at least 90%
(`--sweep-attainment`) of its requests meet every latency target (`--goodput ttft:MS tpot:MS e2el:MS`). Each
probe sends the whole workload open loop at one rate (Poisson, or gamma with `--burstiness`) with fresh
prompt words; failed requests count as missing the SLO. The search doubles the rate from the first
`--request-rate` (1 req/s when that is inf) until a probe fails (or halves it until one passes), then bisects
between the last pass and the first fail `--sweep-steps` times (geometric midpoints). The report gives the rate
found and, from that probe, goodput, throughput and the cost per query and per 1M output tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from pagedserve.bench.metrics import Metrics

MAX_DOUBLINGS = 8


@dataclass(slots=True)
class SweepResult:
    label: str
    max_rate: float | None                       # None: not even the lowest rate tried met the target
    probes: list[tuple[float, Metrics]] = field(default_factory=list)

    @property
    def best(self) -> Metrics | None:
        return next((m for r, m in self.probes if r == self.max_rate), None)


async def find_max_rate(probe: Callable[[float], Awaitable[float | None]], start: float, target: float,
                        steps: int, max_rate: float | None = None) -> float | None:
    """The highest rate with probe(rate) >= target. probe returns the attainment, or None when stopped."""
    lo = hi = None
    stopped = False

    async def passes(rate: float) -> bool:
        nonlocal stopped
        attainment = await probe(rate)
        stopped = stopped or attainment is None
        return attainment is not None and attainment >= target

    rate = start if max_rate is None else min(start, max_rate)
    if await passes(rate):
        lo = rate
        for _ in range(MAX_DOUBLINGS):
            if stopped or (max_rate is not None and lo >= max_rate):
                break
            rate = lo * 2 if max_rate is None else min(lo * 2, max_rate)
            if await passes(rate):
                lo = rate
            else:
                hi = rate
                break
    else:
        hi = rate
        for _ in range(MAX_DOUBLINGS):
            if stopped:
                break
            rate = hi / 2
            if await passes(rate):
                lo = rate
                break
            hi = rate
    if lo is None or hi is None:
        return lo
    for _ in range(steps):
        if stopped:
            break
        mid = math.sqrt(lo * hi)
        if await passes(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def format_sweep(res: SweepResult, target: float, slo_text: str) -> str:
    lines = [f"== sweep {res.label}: highest rate with >= {target:.0%} of requests meeting {slo_text} =="]
    for rate, m in sorted(res.probes, key=lambda p: p[0]):
        lines.append(f"  rate {rate:8.3f}/s  {m.num_good:4d}/{m.num_completed + m.num_failed:<4d} met "
                     f"({m.slo_attainment:6.1%})  goodput {m.goodput:.3f} req/s  "
                     f"output {m.output_throughput:.1f} tok/s")
    best = res.best
    if best is None:
        lines.append("  no rate tried met the target")
        return "\n".join(lines)
    lines.append(f"  max rate      {res.max_rate:.3f} req/s")
    lines.append(f"  there         goodput {best.goodput:.3f} req/s, {best.good_output_throughput:.1f} good output "
                 f"tok/s, TTFT p99 {_fmt(best.ttft and best.ttft.p99 * 1e3, 0)} ms, "
                 f"TPOT p99 {_fmt(best.tpot and best.tpot.p99 * 1e3, 1)} ms")
    if best.price_per_hour is not None:
        lines.append(f"  cost @ ${best.price_per_hour:g}/h  ${_fmt(best.cost_per_million_output_tokens)} per 1M "
                     f"output tokens, ${_fmt(best.cost_per_query, 6)} per query")
    return "\n".join(lines)


def sweep_to_dict(res: SweepResult, target: float) -> dict:
    best = res.best
    return {"endpoint": res.label, "attainment_target": target, "max_rate": res.max_rate,
            "goodput": best.goodput if best else None,
            "cost_per_million_output_tokens": best.cost_per_million_output_tokens if best else None,
            "cost_per_query": best.cost_per_query if best else None,
            "probes": [{"request_rate": r, "metrics": m.to_dict()} for r, m in res.probes]}


def compare_sweeps(results: list[SweepResult]) -> str:
    base = results[0]
    lines = []
    for res in results[1:]:
        ratio = res.max_rate / base.max_rate if res.max_rate and base.max_rate else None
        lines.append(f"max rate {res.label} / {base.label}: " + (f"{ratio:.2f}x" if ratio is not None else "n/a"))
    return "\n".join(lines)


async def run_sweeps(args, endpoints, sampling: dict, slo, stop, report: dict, make_requests, save) -> list[SweepResult]:
    """One sweep per endpoint, in turn; every probe is also a run in report["runs"]. save() rewrites the report."""
    import sys

    from pagedserve.bench.report import run_to_dict
    from pagedserve.bench.runner import run_measured

    start = next((r for r in args.request_rate if math.isfinite(r)), 1.0)
    results = []
    for ep in endpoints:
        res = SweepResult(ep.label, None)
        num_probes = 0

        async def probe(rate: float) -> float | None:
            nonlocal num_probes
            if stop.is_set():
                return None
            reqs = make_requests(num_probes)  # fresh words at every probe: no prefix-cache carry-over
            num_probes += 1
            run, m = await run_measured(ep, reqs, sampling, rate, None, stop, args, slo,
                                        f"{ep.label} sweep {rate:.3g}/s")
            res.probes.append((rate, m))
            report["runs"].append(run_to_dict(run, m, args.save_detailed))
            report["interrupted"] = report["interrupted"] or run.interrupted
            save()
            print(f"sweep {ep.label}: rate {rate:.3f}/s -> {m.num_good}/{m.num_completed + m.num_failed} met the "
                  f"SLO ({m.slo_attainment:.1%})", file=sys.stderr, flush=True)
            return None if run.interrupted else m.slo_attainment

        res.max_rate = await find_max_rate(probe, start, args.sweep_attainment, args.sweep_steps,
                                           args.sweep_max_rate)
        print(format_sweep(res, args.sweep_attainment, slo.describe()), flush=True)
        report["sweeps"].append(sweep_to_dict(res, args.sweep_attainment))
        save()
        results.append(res)
    if len(results) > 1:
        print(compare_sweeps(results), flush=True)
    return results
