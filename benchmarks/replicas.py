"""Replicas behind a router: vllm-router's cache_aware policy against round_robin on a many-tenant chat workload.

    /work/tools/router-venv/bin/pip install vllm-router==0.1.17     # its own venv, not the project's deps
    python benchmarks/replicas.py                                    # 3 replicas, both policies, results/replicas.json
    python benchmarks/replicas.py --stores 6 --users 2 --turns 2 --replicas 2   # a short smoke run

Workload (issue 29): --stores tenants, each with its own ~1,500-token system prompt, --users sessions per
store, each --turns turns long (the history grows with each answer; --think-s between an answer and the next
turn). Sessions start at Poisson times (--session-rate per second) in a seeded order, the same schedule for
both policies: equal offered load. Each policy gets fresh replicas (cold pools) and its own router.
Each replica's pool holds about a third of all system prompts (--kv-cache-memory): round robin sends every
store to every replica, whose pool then thrashes; cache_aware keeps a store on the replica that has its prefix.
Reported per policy: TTFT p50/p90/p99, output tokens/s and requests/s, and per replica the requests served and
the prefix-cache hit rate (from its /metrics). Targets: cache_aware TTFT p90 >= 2x better, throughput >= 1.3x.
Timings need a quiet machine; replicas share its cores (--num-threads each). `--serve-args --kv-offload-dir DIR`
(last) gives the replicas one disk tier: round robin then finds other replicas' prefixes on disk.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_json  # noqa: E402
from serving import Server, free_port, scrape  # noqa: E402

from pagedserve.bench.client import Endpoint, send_request  # noqa: E402
from pagedserve.bench.dataset import WORDS, BenchRequest  # noqa: E402
from pagedserve.bench.metrics import percentiles  # noqa: E402
from pagedserve.bench.runner import make_client  # noqa: E402

ROUTER = "/work/tools/router-venv/bin/vllm-router"


def make_sessions(args) -> tuple[list[str], list[tuple[float, int, list[str]]]]:
    # The system prompts, and (start time, store, user questions) per session in start order: the same for
    # every policy.
    rng = random.Random(args.seed)
    systems = [f"You are the assistant of store {s}. " + " ".join(rng.choice(WORDS) for _ in range(args.system_words))
               for s in range(args.stores)]
    sessions = [(s, [" ".join(rng.choice(WORDS) for _ in range(args.question_words)) for _ in range(args.turns)])
                for s in range(args.stores) for _ in range(args.users)]
    rng.shuffle(sessions)
    t, out = 0.0, []
    for store, questions in sessions:
        out.append((t, store, questions))
        t += rng.expovariate(args.session_rate)
    return systems, out


async def run_session(client, ep: Endpoint, t0: float, start_s: float, system: str, questions: list[str],
                      args, results: list) -> None:
    await asyncio.sleep(max(0.0, t0 + start_s - time.perf_counter()))
    history = system
    for i, q in enumerate(questions):
        if i:
            await asyncio.sleep(args.think_s)
        history += f"\nUser: {q}\nAssistant:"
        res = await send_request(client, ep, BenchRequest(history, len(history.split()), args.output_len),
                                 {"temperature": 0, "ignore_eos": True})
        results.append(res)
        history += " " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(args.output_len // 2))


async def drive(url: str, model: str, systems, sessions, args) -> tuple[list, float]:
    ep = Endpoint(f"{url}/v1", model, "router")
    results: list = []
    async with make_client(None, args.timeout_s) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(run_session(client, ep, t0, s, systems[store], qs, args, results)
                               for s, store, qs in sessions))
        return results, time.perf_counter() - t0


def run_policy(policy: str, args, systems, sessions) -> dict:
    serve = [sys.executable, "-m", "pagedserve.cli", "serve", "--kv-cache-memory", str(args.kv_cache_memory),
             "--num-threads", str(args.num_threads), "--max-model-len", str(args.max_model_len), *args.serve_args]
    servers: list[Server] = []
    try:
        for i in range(args.replicas):
            port = free_port()
            servers.append(Server(f"{policy}-replica{i}", [*serve, "--host", "127.0.0.1", "--port", str(port)], port))
        replicas = [s.url for s in servers]
        port = free_port()
        servers.append(Server(f"{policy}-router", [args.router, "--policy", policy, "--host", "127.0.0.1", "--port",
                                                   str(port), "--worker-urls", *replicas], port))
        model = httpx.get(f"{replicas[0]}/v1/models", timeout=10).json()["data"][0]["id"]
        results, duration = asyncio.run(drive(servers[-1].url, model, systems, sessions, args))
        per_replica = []
        for url in replicas:
            m = scrape(url)
            q = m.get("pagedserve:prefix_cache_queries_total", 0.0)
            per_replica.append({"requests": m.get("pagedserve:request_success_total", 0.0),
                                "prefix_cache_hit_rate": m.get("pagedserve:prefix_cache_hits_total", 0.0) / q if q else None,
                                # with --serve-args --kv-offload-dir DIR: the hits' disk part
                                "kv_offload_hit_tokens": m.get("pagedserve:kv_offload_hit_tokens_total")})
    finally:
        for server in servers:
            server.stop()
    ok = [r for r in results if r.success]
    ttft = percentiles([r.ttft for r in ok])
    out_tokens = sum(r.output_tokens for r in ok)
    return {"policy": policy, "num_requests": len(results), "num_failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if r.error})[:5], "duration_s": duration,
            "ttft_s": None if ttft is None else {"p50": ttft.p50, "p90": ttft.p90, "p99": ttft.p99, "mean": ttft.mean},
            "output_tok_per_s": out_tokens / duration, "requests_per_s": len(ok) / duration,
            "mean_prompt_tokens": sum(r.prompt_len for r in ok) / max(1, len(ok)), "replicas": per_replica}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--stores", type=int, default=24)
    p.add_argument("--users", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=1500, help="about one token each")
    p.add_argument("--question-words", type=int, default=20)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--session-rate", type=float, default=0.5, help="sessions started per second (Poisson)")
    p.add_argument("--think-s", type=float, default=1.0)
    p.add_argument("--kv-cache-memory", type=int, default=300 << 20,
                   help="per replica; the default holds ~13,000 float32 or ~26,000 bf16 tokens of the embedded model")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-threads", type=int, default=max(1, (os.cpu_count() or 1) // 3))
    p.add_argument("--router", default=ROUTER)
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="passed to every replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "replicas.json"))
    args = p.parse_args()
    if not os.path.exists(args.router):
        sys.exit(f"no router at {args.router}: python3 -m venv /work/tools/router-venv && "
                 "/work/tools/router-venv/bin/pip install vllm-router==0.1.17 (or pass --router)")
    systems, sessions = make_sessions(args)
    result = {"machine": machine_info(), "args": vars(args), "runs": {}}
    for policy in args.policies:
        run = result["runs"][policy] = run_policy(policy, args, systems, sessions)
        print({k: run[k] for k in ("policy", "num_failed", "ttft_s", "output_tok_per_s", "replicas")}, flush=True)
    runs = result["runs"]
    if {"round_robin", "cache_aware"} <= set(runs) and runs["cache_aware"]["ttft_s"] and runs["round_robin"]["ttft_s"]:
        rr, ca = runs["round_robin"], runs["cache_aware"]
        result["cache_aware_vs_round_robin"] = {
            "ttft_p90_ratio": rr["ttft_s"]["p90"] / ca["ttft_s"]["p90"],
            "throughput_ratio": ca["output_tok_per_s"] / rr["output_tok_per_s"]}
        print(result["cache_aware_vs_round_robin"], flush=True)
    result["load_avg_1_5_15_end"] = list(os.getloadavg())
    write_json(args.out, result)


if __name__ == "__main__":
    main()
