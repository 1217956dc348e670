"""The HTTP front-end's cost: one workload offline through LLM.generate and over HTTP, same engine flags, one run.

    python benchmarks/http_offline.py --out benchmarks/results/http_offline.json
    python benchmarks/http_offline.py --budgets 512 1024 2048 adaptive --skip-offline --rounds 2 \
        --out benchmarks/results/token_budget_http.json

Both sides get the same prompts as token ids (random, seeded; fresh ids every round so no prefix-cache hit
carries over, the same lengths), greedy, ignore_eos, and the same engine flags (--max-num-seqs, --num-threads,
--dtype, the KV pool, the token budget). Offline, one LLM.generate call holds every request, so the batch stays
full; over HTTP, `pagedserve serve` in a subprocess gets --concurrency streams (a closed loop, default
--max-num-seqs) from the `pagedserve bench serve` client. The ratio is output tokens/s over HTTP divided by
offline. Rounds alternate the order (offline first, then HTTP first) so drifting machine load hits both.

--budgets takes `adaptive` (the server's default, 512..2048), `N` (fixed N) or `LO-HI`; each gets its own
server (and its own offline LLM unless --skip-offline), and the report gives TTFT and TPOT percentiles for each.
The client runs on the same machine as the server, so it competes for the same cores: that is part of the cost.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import signal
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import allowed_token_ids, machine_info, write_json  # noqa: E402
from serving import Server, free_port  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.bench.client import Endpoint  # noqa: E402
from pagedserve.bench.dataset import parse_range  # noqa: E402
from pagedserve.bench.metrics import SLO, compute_metrics  # noqa: E402
from pagedserve.bench.runner import run_load  # noqa: E402
from pagedserve.bench.words import BenchRequest  # noqa: E402
from pagedserve.config import CHUNKED_PREFILL_BATCHED_TOKENS, MIN_BATCHED_TOKENS  # noqa: E402


def parse_budget(text: str) -> tuple[int, int]:
    # (floor, maximum) of the step's token budget.
    if text == "adaptive":
        return MIN_BATCHED_TOKENS, CHUNKED_PREFILL_BATCHED_TOKENS
    return parse_range(text)


def workload(args, token_ids: list[int], variant: int) -> list[tuple[list[int], int]]:
    # Lengths depend on the seed only, the ids also on the round: every round is the same shape, never cached.
    lengths, ids = random.Random(args.seed), random.Random(f"{args.seed}/{variant}")
    reqs = []
    for _ in range(args.num_prompts):
        n_in, n_out = lengths.randint(*args.input_len), lengths.randint(*args.output_len)
        reqs.append(([ids.choice(token_ids) for _ in range(n_in)], n_out))
    return reqs


def engine_flags(args, budget: tuple[int, int]) -> dict:
    return {"dtype": args.dtype, "num_threads": args.num_threads, "max_num_seqs": args.max_num_seqs,
            "kv_cache_memory_bytes": args.kv_cache_memory, "max_model_len": args.max_model_len,
            "min_num_batched_tokens": budget[0], "max_num_batched_tokens": budget[1]}


def serve_command(args, budget: tuple[int, int], port: int) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_flags(args, budget).items()]
    if args.model:
        flags.append(f"--model={args.model}")
    return [sys.executable, "-m", "pagedserve.cli", "serve", *flags, "--port", str(port),
            "--uvicorn-log-level", "warning"]


def thread_cpu_s(pid: int) -> tuple[float, float]:
    # (main thread, whole process) CPU seconds from /proc: the main thread runs the server's event loop.
    tick, main, total = os.sysconf("SC_CLK_TCK"), 0.0, 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        t = (int(fields[11]) + int(fields[12])) / tick
        total += t
        main += t if int(tid) == pid else 0.0
    return main, total


def engine_counters(stats) -> dict:
    return {"num_steps": stats.num_steps, "step_time_total_s": stats.step_time_total,
            "generation_tokens_total": stats.num_generation_tokens_total}


def step_summary(before: dict, after: dict, wall: float) -> dict:
    # Where the engine's time went: steps (how many, how long), and the share of the wall time spent in them.
    steps = after["num_steps"] - before["num_steps"]
    busy = after["step_time_total_s"] - before["step_time_total_s"]
    tokens = after["generation_tokens_total"] - before["generation_tokens_total"]
    return {"num_steps": steps, "mean_step_ms": 1e3 * busy / max(steps, 1), "tokens_per_step": tokens / max(steps, 1),
            "engine_busy_share": busy / wall}


def run_offline(llm: LLM, reqs: list[tuple[list[int], int]]) -> dict:
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    gc.collect()
    before = engine_counters(llm.llm_engine.stats)
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"duration_s": wall, "output_tokens": tokens, "output_throughput": tokens / wall,
            "cpu_us_per_token": 1e6 * cpu / tokens,
            **step_summary(before, engine_counters(llm.llm_engine.stats), wall)}


def server_counters(url: str) -> dict:
    return httpx.get(f"{url}/debug/kv", timeout=60).json()["engine"]


def run_http(ep: Endpoint, reqs: list[tuple[list[int], int]], concurrency: int, pid: int | None = None) -> dict:
    bench = [BenchRequest(ids, len(ids), n) for ids, n in reqs]  # a list of ids is a valid completions prompt
    url = ep.base_url.removesuffix("/v1")
    before = server_counters(url) if pid else {}
    server_cpu, client_cpu = thread_cpu_s(pid) if pid else (0.0, 0.0), time.process_time()
    run = asyncio.run(run_load(ep, bench, {"temperature": 0.0, "ignore_eos": True}, concurrency=concurrency))
    client_cpu = time.process_time() - client_cpu
    m = compute_metrics(run.results, run.duration_s, SLO(), None)
    if m.num_failed or m.total_output_tokens != sum(n for _, n in reqs):
        raise RuntimeError(f"HTTP run incomplete: {m.num_failed} failed, errors {m.errors}")
    out = {k: v for k, v in m.to_dict().items() if k in (
        "duration_s", "output_throughput", "total_output_tokens", "ttft", "tpot", "itl", "e2el")}
    if pid:
        main, total = thread_cpu_s(pid)
        tokens = m.total_output_tokens
        time.sleep(1.1)  # /debug/kv renews its snapshot at most once a second
        out.update({"server_cpu_us_per_token": 1e6 * (total - server_cpu[1]) / tokens,
                    "event_loop_cpu_us_per_token": 1e6 * (main - server_cpu[0]) / tokens,
                    "client_cpu_us_per_token": 1e6 * client_cpu / tokens,
                    **step_summary(before, server_counters(url), m.duration_s)})
    return out


SIDE_KEYS = ("num_steps", "mean_step_ms", "tokens_per_step", "engine_busy_share")
HTTP_CPU_KEYS = ("server_cpu_us_per_token", "event_loop_cpu_us_per_token", "client_cpu_us_per_token")


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF or HF directory (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=parse_range, default=(64, 512))
    p.add_argument("--output-len", type=parse_range, default=(16, 256))
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=None, help="HTTP streams (default: --max-num-seqs)")
    p.add_argument("--budgets", nargs="+", default=["adaptive"], help="adaptive, N or LO-HI (default adaptive)")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip-offline", action="store_true", help="only the servers (the budget sweep)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    concurrency = args.concurrency or args.max_num_seqs
    budgets = {b: parse_budget(b) for b in args.budgets}
    meta = {"machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k != "out"}}
    llms = {} if args.skip_offline else {b: LLM(model=args.model, **engine_flags(args, lim))
                                         for b, lim in budgets.items()}
    tokenizer = (next(iter(llms.values())).get_tokenizer() if llms else
                 LLM(model=args.model, dtype=args.dtype, num_threads=1, kv_cache_memory_bytes=64 << 20,
                     max_model_len=args.max_model_len).get_tokenizer())
    token_ids = allowed_token_ids(tokenizer, len(tokenizer))
    servers: dict[str, Server] = {}
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the finally below stops the servers (own process groups).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: dict[str, dict[str, list]] = {b: {"offline": [], "http": []} for b in budgets}
    try:
        for b, lim in budgets.items():
            port = free_port()
            servers[b] = Server(f"pagedserve-{b}", serve_command(args, lim, port), port)
        endpoints = {b: Endpoint(f"{s.url}/v1", httpx.get(f"{s.url}/v1/models").json()["data"][0]["id"], b)
                     for b, s in servers.items()}
        # Kernels loaded and first-call allocations made for full-size prefills; few output tokens.
        warm = [(ids, min(n, 4)) for ids, n in workload(args, token_ids, variant=-1)[:concurrency]]
        for b in budgets:  # kernels loaded, first-call allocations done, on both sides
            if b in llms:
                run_offline(llms[b], warm)
            run_http(endpoints[b], warm, concurrency)
        for rnd in range(args.rounds):
            reqs = workload(args, token_ids, variant=rnd)
            order = ["offline", "http"] if rnd % 2 == 0 else ["http", "offline"]
            for b in budgets:
                for side in order:
                    if side == "offline" and b not in llms:
                        continue
                    r = (run_offline(llms[b], reqs) if side == "offline" else
                         run_http(endpoints[b], reqs, concurrency, servers[b].proc.pid))
                    r["load_avg_1"] = os.getloadavg()[0]
                    rows[b][side].append(r)
                    cpu = (f"CPU {r['cpu_us_per_token']:.0f} us/token" if side == "offline" else
                           f"CPU server {r['server_cpu_us_per_token']:.0f} (event loop "
                           f"{r['event_loop_cpu_us_per_token']:.0f}) + client {r['client_cpu_us_per_token']:.0f} us/token")
                    print(f"round {rnd} budget {b} {side:7s}: {r['output_throughput']:6.1f} output tok/s "
                          f"({r['duration_s']:.1f} s, load {r['load_avg_1']:.1f}); {r['num_steps']} steps of "
                          f"{r['mean_step_ms']:.1f} ms, {r['tokens_per_step']:.1f} tokens each, engine busy "
                          f"{100 * r['engine_busy_share']:.0f}%; {cpu}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    summary = {}
    for b in budgets:
        http, offline = rows[b]["http"], rows[b]["offline"]
        s = {"http_output_throughput": median(http, "output_throughput"),
             "ttft_p50_s": statistics.median(r["ttft"]["p50"] for r in http),
             "ttft_p99_s": statistics.median(r["ttft"]["p99"] for r in http),
             "tpot_p50_s": statistics.median(r["tpot"]["p50"] for r in http),
             "tpot_p99_s": statistics.median(r["tpot"]["p99"] for r in http),
             **{f"http_{k}": median(http, k) for k in SIDE_KEYS + HTTP_CPU_KEYS}}
        if offline:
            s["offline_output_throughput"] = median(offline, "output_throughput")
            s.update({f"offline_{k}": median(offline, k) for k in SIDE_KEYS + ("cpu_us_per_token",)})
            s["http_over_offline"] = s["http_output_throughput"] / s["offline_output_throughput"]
            # Per round, the pair measured back to back.
            s["http_over_offline_per_round"] = [h["output_throughput"] / o["output_throughput"]
                                                for h, o in zip(http, offline)]
        summary[b] = s
        print(f"budget {b}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in s.items()))
    meta["machine"]["load_avg_1_5_15_at_end"] = list(os.getloadavg())
    if args.out:
        write_json(args.out, {**meta, "summary": summary, "rounds": rows,
                              "servers": {b: " ".join(s.cmd[1:]) for b, s in servers.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
