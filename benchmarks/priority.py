"""Priority under a saturating low-priority load: urgent requests' TTFT against an idle server's (issue 28).

    python benchmarks/priority.py --out benchmarks/results/priority.json

Starts `pagedserve serve --scheduling-policy priority` and a default (fcfs) server on free ports, with the same
engine flags, and on each in turn measures:

1. idle: --num-probes urgent requests (priority 0), one at a time, each --probe-gap seconds on average after the
   last one's end (exponential gaps), alone: the reference TTFT;
2. load alone: --num-low long requests (priority --low-priority) sent at once, more than --max-num-seqs, so
   the batch and the queue are full: their output tokens/s. All of the same length unless --low-len-spread:
   such a load runs in lockstep waves when it happens to start together, which the probes break (a cost of
   their own beside their work: benchmarks/README.md);
3. load + probes: the same load, and the same probes once it runs: the probes' TTFT and the load's tokens/s.
   Only probes sent before the load ended count in (3) (`probes_during_load`); the defaults send all of them
   while it runs on a 2-core Xeon (about 10 s of load).

(2) and (3) repeat --rounds times, each with fresh prompts, (2) first in even rounds and (3) first in odd ones;
the report gives each round and the median.

Targets (issue 28): under the priority policy the probes' TTFT p99 in (3) within 2x of (1), and the load's
throughput lower in (3) than in (2) by no more than the probes' own work: their share of the tokens the server
computed in (3), prompt and output (`probe_work_share`; `probe_token_share` counts output tokens only). The fcfs
server shows what the probes wait without priorities (behind the whole queue). Timings need a quiet machine.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info  # noqa: E402
from serving import Server, free_port, scrape  # noqa: E402

from pagedserve.bench.client import Endpoint, send_request  # noqa: E402
from pagedserve.bench.dataset import random_requests  # noqa: E402
from pagedserve.bench.metrics import percentiles  # noqa: E402
from pagedserve.bench.report import write_json  # noqa: E402
from pagedserve.bench.runner import make_client  # noqa: E402


async def probes(ep: Endpoint, args, variant: int) -> list:
    reqs = random_requests(args.num_probes, (args.probe_input_len,) * 2, (args.probe_output_len,) * 2,
                           seed=1, variant=variant)
    sampling = {"temperature": 0.0, "ignore_eos": True, "priority": 0}
    # Gaps drawn from an exponential distribution (Poisson arrivals): with a fixed gap the probes meet the load's
    # long prefill steps, or miss them, by how the machine's speed lines them up.
    gaps = random.Random(variant)
    results = []
    async with make_client(None, 600.0) as client:
        for req in reqs:
            sent = time.perf_counter()
            results.append((sent, await send_request(client, ep, req, sampling)))
            await asyncio.sleep(gaps.expovariate(1 / args.probe_gap))
    return results


async def low_load(ep: Endpoint, args, variant: int, priority: int) -> tuple[float, float, int, int]:
    reqs = random_requests(args.num_low, spread(args.low_input_len, args.low_len_spread),
                           spread(args.low_output_len, args.low_len_spread), seed=2, variant=variant)
    sampling = {"temperature": 0.0, "ignore_eos": True, **({"priority": priority} if priority else {})}
    start = time.perf_counter()
    async with make_client(None, 3600.0) as client:
        results = await asyncio.gather(*(send_request(client, ep, r, sampling) for r in reqs))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} low-priority requests failed: {failed[0]}")
    return start, time.perf_counter(), sum(r.output_tokens for r in results), sum(r.prompt_len for r in results)


def spread(length: int, fraction: float) -> tuple[int, int]:
    # Lengths drawn from length * (1 -+ fraction): the same in every round (they depend on the seed only).
    return round(length * (1 - fraction)), round(length * (1 + fraction))


def summary(results: list) -> dict:
    ttft = percentiles([r.ttft for r in results if r.success and r.ttft is not None])
    return {"num_ok": sum(r.success for r in results), "ttft_p50_s": ttft and ttft.p50,
            "ttft_p99_s": ttft and ttft.p99, "output_tokens": sum(r.output_tokens for r in results),
            "prompt_tokens": sum(r.prompt_len for r in results)}


# The server's counters of each phase: what it computed beyond the requests' tokens (prompts computed again after
# a preemption that gave its blocks back, prefix-cache hits) and how often it paused or preempted a request.
COUNTERS = ("num_preemptions_total", "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
            "prefix_cache_hits_total")


def counted(url: str, before: dict[str, float]) -> dict[str, float]:
    after = scrape(url)
    return {name: after[f"pagedserve:{name}"] - before[f"pagedserve:{name}"] for name in COUNTERS}


async def measure(ep: Endpoint, args, low_priority: int) -> dict:
    idle = summary([r for _, r in await probes(ep, args, variant=1)])
    rounds, loaded_probes = [], []
    server_url = ep.base_url.removesuffix("/v1")
    for r in range(args.rounds):
        counters = {}

        async def alone() -> tuple[float, int]:
            before = scrape(server_url)
            start, end, tokens, _ = await low_load(ep, args, 2 * r + 1, low_priority)
            counters["alone"] = counted(server_url, before)
            return end - start, tokens

        async def probes_after_start() -> list:
            await asyncio.sleep(args.load_head_start)
            return await probes(ep, args, variant=100 + r)

        async def with_probes() -> tuple:
            before = scrape(server_url)
            out = await asyncio.gather(low_load(ep, args, 2 * r + 2, low_priority), probes_after_start())
            counters["with_probes"] = counted(server_url, before)
            return out

        # In turns (alone first in even rounds, second in odd ones), so a drift over the server's life does not
        # count against one of the two.
        if r % 2 == 0:
            alone_s, alone_tokens = await alone()
            (start, end, loaded_tokens, loaded_prompt), sent = await with_probes()
        else:
            (start, end, loaded_tokens, loaded_prompt), sent = await with_probes()
            alone_s, alone_tokens = await alone()
        loaded_s = end - start
        # Only probes sent while the load ran compete with it: their work is what the load may lose.
        during = [res for at, res in sent if at < end]
        loaded_probes += during
        p = summary(during)
        rounds.append({
            "low_alone": {"seconds": alone_s, "output_tokens_per_s": alone_tokens / alone_s},
            "low_with_probes": {"seconds": loaded_s, "output_tokens_per_s": loaded_tokens / loaded_s},
            "probes_during_load": len(during),
            "probes": p,
            "server_counters": counters,
            "low_throughput_drop": 1 - (loaded_tokens / loaded_s) / (alone_tokens / alone_s),
            # the share of the probes sent during the load in its output, and in all it computed (prompt + output)
            "probe_token_share": p["output_tokens"] / (p["output_tokens"] + loaded_tokens),
            "probe_work_share": (p["output_tokens"] + p["prompt_tokens"])
            / (p["output_tokens"] + p["prompt_tokens"] + loaded_tokens + loaded_prompt)})
    loaded = summary(loaded_probes)
    out = {"idle": idle, "loaded": loaded, "rounds": rounds}
    for q in ("p50", "p99"):
        if idle[f"ttft_{q}_s"] and loaded[f"ttft_{q}_s"]:
            out[f"ttft_{q}_loaded_over_idle"] = loaded[f"ttft_{q}_s"] / idle[f"ttft_{q}_s"]
    for key in ("low_throughput_drop", "probe_token_share", "probe_work_share"):
        out[key] = statistics.median(r[key] for r in rounds)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-low", type=int, default=32)
    p.add_argument("--low-input-len", type=int, default=256)
    p.add_argument("--low-output-len", type=int, default=256)
    p.add_argument("--low-priority", type=int, default=10)
    p.add_argument("--low-len-spread", type=float, default=0.0, metavar="FRACTION",
                   help="draw the load's input and output lengths from len * (1 -+ FRACTION); 0: all the same, so "
                        "the load runs in lockstep waves, which any urgent request breaks")
    p.add_argument("--num-probes", type=int, default=8)
    p.add_argument("--probe-input-len", type=int, default=64)
    p.add_argument("--probe-output-len", type=int, default=16)
    p.add_argument("--probe-gap", type=float, default=1.0, metavar="S")
    p.add_argument("--load-head-start", type=float, default=1.0, metavar="S",
                   help="seconds between sending the load and the first probe")
    p.add_argument("--rounds", type=int, default=3, help="load alone / load with probes, in turns")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20, metavar="BYTES")
    p.add_argument("--servers", nargs="+", choices=["priority", "fcfs"], default=["priority", "fcfs"])
    p.add_argument("--out", default=None, metavar="FILE.json")
    args = p.parse_args()
    engine = [sys.executable, "-m", "pagedserve.cli", "serve", "--num-threads", str(args.num_threads),
              "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", str(args.kv_cache_memory),
              "--uvicorn-log-level", "warning"]
    report = {"machine": machine_info(), "config": vars(args), "servers": {}}
    for name in args.servers:
        port = free_port()
        policy = ["--scheduling-policy", "priority"] if name == "priority" else []
        server = Server(name, [*engine, *policy, "--port", str(port)], port)
        try:
            ep = Endpoint(f"{server.url}/v1", asyncio.run(warm_up(f"{server.url}/v1")), name)
            result = asyncio.run(measure(ep, args, args.low_priority if name == "priority" else 0))
        finally:
            server.stop()
        report["servers"][name] = {"command": " ".join(server.cmd[1:]), **result}
        nan = float("nan")  # no probe ran during the load (it was too short)
        print(f"{name}: probes TTFT p99 idle {result['idle']['ttft_p99_s'] or nan:.3f} s, under load "
              f"{result['loaded']['ttft_p99_s'] or nan:.3f} s ({result.get('ttft_p99_loaded_over_idle', 0):.2f}x; p50 "
              f"{result.get('ttft_p50_loaded_over_idle', 0):.2f}x); "
              f"load throughput drop (median of {args.rounds}) {result['low_throughput_drop']:.1%}, probes' "
              f"share of the work {result['probe_work_share']:.1%} (of output {result['probe_token_share']:.1%})",
              flush=True)
        if args.out:
            write_json(args.out, report)
    report["load_average_after"] = os.getloadavg()
    if args.out:
        write_json(args.out, report)
    return 0


async def warm_up(base_url: str) -> str:
    # The served model's name, and first-call costs paid outside every measurement.
    async with make_client(None, 600.0) as client:
        async with client.get(f"{base_url}/models") as response:
            model = (await response.json())["data"][0]["id"]
        for req in random_requests(2, (16, 16), (4, 4), seed=3):
            await send_request(client, Endpoint(base_url, model, "warmup"), req, {"temperature": 0.0})
    return model


if __name__ == "__main__":
    sys.exit(main())
