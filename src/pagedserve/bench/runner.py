"""Drive one workload against one endpoint: Poisson arrivals, a concurrency cap, or both, stoppable.

    rate = inf, concurrency = C   fixed concurrency: C requests in flight until the workload is drained
    rate = R,   concurrency None  open loop: exponential inter-arrival gaps (a Poisson process) of mean 1/R;
                                  with burstiness b != 1, gamma gaps of shape b and the same mean (vLLM's
                                  --burstiness: below 1 burstier, above 1 more regular)
    rate = R,   concurrency = C   Poisson arrivals that wait for one of C slots (a client-side queue)
Latencies are measured from the moment a request is actually sent, so client-side queueing is not counted
as server latency; it shows as lower throughput instead.

Setting `stop` (Ctrl-C) sends nothing more, cancels what is in flight (the server sees the connection close
and can free its work) and returns what finished, so a long run interrupted still reports.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import aiohttp

from pagedserve.bench.client import Endpoint, RequestResult, send_request
from pagedserve.bench.dataset import BenchRequest


@dataclass(slots=True)
class RunResult:
    endpoint: Endpoint
    request_rate: float               # math.inf for "send as fast as the concurrency allows"
    concurrency: int | None
    results: list[RequestResult]      # finished requests (success or failure), in completion order
    num_cancelled: int
    num_not_sent: int
    duration_s: float
    interrupted: bool


def make_client(concurrency: int | None, timeout_s: float) -> aiohttp.ClientSession:
    """The HTTP session of a run; timeout_s bounds each read (a stream may take longer in all). Call it
    inside the event loop that uses it. Proxies from the environment are honoured (trust_env)."""
    # No pool limit unless a concurrency cap bounds the connections anyway: a pool that queued requests
    # would add client-side waiting to the measured TTFT.
    connector = aiohttp.TCPConnector(limit=concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=True)


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass


async def run_load(ep: Endpoint, requests: list[BenchRequest], sampling: dict, request_rate: float = math.inf,
                   concurrency: int | None = None, stop: asyncio.Event | None = None, progress=None,
                   seed: int = 0, timeout_s: float = 600.0, burstiness: float = 1.0) -> RunResult:
    stop = stop or asyncio.Event()
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    results: list[RequestResult] = []
    num_sent = 0  # requests past the concurrency gate; the rest were never sent when a stop cancels them

    async def send(client: aiohttp.ClientSession, req: BenchRequest) -> RequestResult:
        nonlocal num_sent
        num_sent += 1
        return await send_request(client, ep, req, sampling)

    async def one(client: aiohttp.ClientSession, req: BenchRequest) -> None:
        try:
            if sem is None:
                r = await send(client, req)
            else:
                async with sem:
                    r = await send(client, req)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a client bug must not lose the other results
            r = RequestResult(prompt_len=req.prompt_len, max_tokens=req.output_len,
                              error=f"client error: {type(e).__name__}: {e}")
        results.append(r)
        if progress is not None:
            progress.update(1)
            if not r.success:
                progress.set_postfix(failed=sum(not x.success for x in results), refresh=False)

    async with make_client(concurrency, timeout_s) as client:
        tasks: list[asyncio.Task] = []
        t0 = time.perf_counter()
        for i, req in enumerate(requests):
            if stop.is_set():
                break
            tasks.append(asyncio.create_task(one(client, req)))
            if math.isfinite(request_rate) and i < len(requests) - 1:
                gap = (rng.expovariate(request_rate) if burstiness == 1.0 else
                       rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)))
                await _sleep_unless(stop, gap)
        stopper = asyncio.ensure_future(stop.wait())
        waiter = asyncio.ensure_future(asyncio.wait(tasks)) if tasks else None
        await asyncio.wait([f for f in (stopper, waiter) if f], return_when=asyncio.FIRST_COMPLETED)
        end = time.perf_counter()
        in_flight = [t for t in tasks if not t.done()]
        for t in in_flight + [stopper] + ([waiter] if waiter else []):
            t.cancel()
        await asyncio.gather(*tasks, stopper, *([waiter] if waiter else []), return_exceptions=True)
    return RunResult(endpoint=ep, request_rate=request_rate, concurrency=concurrency, results=results,
                     num_cancelled=num_sent - len(results), num_not_sent=len(requests) - num_sent,
                     duration_s=end - t0, interrupted=bool(in_flight) or len(tasks) < len(requests))


async def run_measured(ep: Endpoint, requests: list[BenchRequest], sampling: dict, rate: float,
                       concurrency: int | None, stop: asyncio.Event, args, slo, desc: str):
    """run_load with a progress bar (unless --no-progress) and the run's metrics: (RunResult, Metrics)."""
    import sys

    from tqdm import tqdm

    from pagedserve.bench.metrics import compute_metrics

    if args.cooldown > 0:
        await asyncio.sleep(args.cooldown)
    bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr, disable=args.no_progress,
               dynamic_ncols=True)
    try:
        run = await run_load(ep, requests, sampling, rate, concurrency, stop, bar, args.seed, args.timeout,
                             args.burstiness)
    finally:
        bar.close()
    return run, compute_metrics(run.results, run.duration_s, slo, args.price_per_hour, run.num_cancelled,
                                run.num_not_sent)
