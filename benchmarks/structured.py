"""Structured outputs overhead (issue 13): decode TPOT at 16 concurrent streams when half of them decode under
a JSON schema, against the same 16 streams with no constraint. Target: < 10% overhead.

Every stream asks for the same number of tokens; the schema (an array of exactly 24 hourly rows) is longer
than that, so constrained streams also run to max_tokens and both runs decode the same token counts. Runs
alternate (plain, mixed, plain, mixed, ...) on one server, so drift in machine load hits both alike. Besides
wall-clock TPOT it records the server process's CPU seconds per output token, which a busy machine disturbs
far less than it disturbs wall time (on 2 shared cores, TPOT swings with other processes; CPU work does not).
First, an offline step profile (the same 16 streams through LLM.generate on one torch thread) splits the
engine thread's CPU time into the whole step and the grammar work in it (bitmask fill + apply, token accept).

    flock /work/wt/BENCH_LOCK -c "cd benchmarks && python structured.py --out results/structured.json"
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

from common import machine_info, write_json
from pagedserve.bench.client import Endpoint, list_models, send_request
from pagedserve.bench.dataset import BenchRequest
from pagedserve.bench.runner import make_client
from serving import Server, free_port

PROMPT = "Visitors of store 12 on 2026-03-04, per hour, as JSON:"


def hourly_schema(i: int) -> dict:
    # A distinct schema per constrained stream (each compiles once, off the engine thread).
    return {"type": "object", "properties": {
        "store": {"type": "integer", "minimum": 1, "maximum": 999},
        "rows": {"type": "array", "minItems": 24, "maxItems": 24, "items": {
            "type": "object", "properties": {
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "visitors": {"type": "integer", "minimum": 0, "maximum": 900 + i},
                "busy": {"type": "boolean"}},
            "required": ["hour", "visitors", "busy"]}}},
        "required": ["store", "rows"]}


def sampling(schema: dict | None) -> dict:
    body = {"temperature": 0, "ignore_eos": True}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "visitors", "schema": schema}}
    return body


def cpu_seconds(pid: int) -> float:
    # utime + stime of the whole process (all threads: engine, OpenMP workers, tokenizer, grammar compiles).
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(url: str, schemas: list[dict | None], max_tokens: int, pid: int) -> dict:
    async with make_client(None, 900.0) as client:
        base = f"{url}/v1"
        ep = Endpoint(base, (await list_models(client, base, None))[0], "pagedserve")
        req = BenchRequest(PROMPT, len(PROMPT.split()), max_tokens)
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        results = await asyncio.gather(*(send_request(client, ep, req, sampling(s)) for s in schemas))
        wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    bad = [r.error or f"{r.output_tokens} tokens" for r in results if not r.success or r.output_tokens != max_tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} streams failed or ran short: {bad[:3]}")
    return {"wall_s": wall, "cpu_s": cpu, "cpu_s_per_token": cpu / sum(r.output_tokens for r in results),
            "streams": [{"constrained": s is not None, "ttft": r.ttft, "tpot": r.tpot}
                        for s, r in zip(schemas, results)]}


def offline_step_profile(max_tokens: int, streams: int) -> dict:
    # One torch thread: the engine thread's CPU time (time.thread_time) is then all of a step's work, and the
    # grammar part is timed around its three calls. Grammars compile on other threads, not counted.
    from pagedserve import LLM, SamplingParams
    from pagedserve.sampling_params import StructuredOutputsParams

    llm = LLM(kv_cache_memory_bytes=256 << 20, max_model_len=2048, max_num_seqs=streams, num_threads=1)
    from pagedserve.worker import model_runner

    manager = llm.llm_engine.core.structured_output
    grammar_cpu = [0.0]

    def timed(fn):
        def call(*a, **k):
            t = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                grammar_cpu[0] += time.thread_time() - t
        return call

    # The core fills the plan's bitmask and accepts tokens; the runner masks the logits with the bitmask.
    manager.grammar_output, manager.accept_token = timed(manager.grammar_output), timed(manager.accept_token)
    model_runner.apply_grammar_bitmask = timed(model_runner.apply_grammar_bitmask)
    out = {}
    for name, mixed, num_tokens in (("warmup", True, 4), ("plain", False, max_tokens), ("mixed", True, max_tokens)):
        params = [SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, structured_outputs=
                                 StructuredOutputsParams(json=hourly_schema(-i)) if mixed and i % 2 else None)
                  for i in range(streams)]
        grammar_cpu[0] = 0.0
        t = time.thread_time()
        llm.generate([PROMPT] * streams, params, use_tqdm=False)
        out[f"{name}_engine_cpu_s"] = time.thread_time() - t
        out[f"{name}_grammar_cpu_s"] = grammar_cpu[0]
    del out["warmup_engine_cpu_s"], out["warmup_grammar_cpu_s"]
    out["engine_cpu_ratio"] = out["mixed_engine_cpu_s"] / out["plain_engine_cpu_s"]
    out["grammar_share_of_mixed"] = out["mixed_grammar_cpu_s"] / out["mixed_engine_cpu_s"]
    return out


def p50(runs: list[dict], key: str, constrained: bool | None = None) -> float:
    return statistics.median(x[key] for r in runs for x in r["streams"]
                             if constrained is None or x["constrained"] == constrained)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="plain/mixed pairs")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--no-server", action="store_true", help="the offline step profile only")
    args = p.parse_args()
    info = machine_info()
    profile = offline_step_profile(args.max_tokens, args.streams)
    print(f"offline, engine-thread CPU: plain {profile['plain_engine_cpu_s']:.2f}s, mixed "
          f"{profile['mixed_engine_cpu_s']:.2f}s ({profile['engine_cpu_ratio']:.3f}x); grammar work "
          f"{profile['mixed_grammar_cpu_s']:.3f}s = {100 * profile['grammar_share_of_mixed']:.2f}% of mixed",
          file=sys.stderr, flush=True)
    if args.no_server:
        return 0
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port), "--max-model-len", "2048",
           "--kv-cache-memory", str(256 << 20), "--max-num-seqs", str(args.streams), "--uvicorn-log-level", "warning",
           "--structured-outputs-compile-timeout", "120"]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    server = Server("pagedserve", cmd, port)
    pid = server.proc.pid
    plain_runs, mixed_runs = [], []
    try:
        # Warm-up: the xgrammar tokenizer info, the first compile, the model's first steps.
        asyncio.run(run(server.url, [None, hourly_schema(-1)], 8, pid))
        for r in range(args.rounds):
            plain_runs.append(asyncio.run(run(server.url, [None] * args.streams, args.max_tokens, pid)))
            # Fresh schemas each round: their compiles overlap the other streams' decoding.
            schemas = [hourly_schema(100 * r + i) if i % 2 else None for i in range(args.streams)]
            mixed_runs.append(asyncio.run(run(server.url, schemas, args.max_tokens, pid)))
            q, m = plain_runs[-1], mixed_runs[-1]
            print(f"round {r}: TPOT p50 plain {p50([q], 'tpot'):.4f}s mixed {p50([m], 'tpot'):.4f}s; "
                  f"server CPU/token plain {q['cpu_s_per_token'] * 1e3:.2f}ms mixed "
                  f"{m['cpu_s_per_token'] * 1e3:.2f}ms", file=sys.stderr, flush=True)
    finally:
        server.stop()

    plain, mixed = p50(plain_runs, "tpot"), p50(mixed_runs, "tpot")
    cpu_ratios = [m["cpu_s_per_token"] / q["cpu_s_per_token"] for q, m in zip(plain_runs, mixed_runs)]
    data = {
        "machine": info, "command": " ".join(sys.argv),
        "config": {"streams": args.streams, "max_tokens": args.max_tokens, "rounds": args.rounds,
                   "constrained_per_mixed_run": args.streams // 2, "prompt": PROMPT, "schema": hourly_schema(0)},
        "offline_step_profile": profile,
        "tpot_p50_plain_s": plain, "tpot_p50_mixed_s": mixed,
        "tpot_p50_mixed_constrained_streams_s": p50(mixed_runs, "tpot", True),
        "tpot_p50_mixed_free_streams_s": p50(mixed_runs, "tpot", False),
        "overhead_ratio": mixed / plain,
        "overhead_ratio_per_round": [p50([m], "tpot") / p50([q], "tpot") for q, m in zip(plain_runs, mixed_runs)],
        "server_cpu_s_per_token_plain": [r["cpu_s_per_token"] for r in plain_runs],
        "server_cpu_s_per_token_mixed": [r["cpu_s_per_token"] for r in mixed_runs],
        "cpu_overhead_ratio_median": statistics.median(cpu_ratios), "cpu_overhead_ratio_per_round": cpu_ratios,
        "ttft_p50_plain_s": p50(plain_runs, "ttft"),
        "ttft_p50_mixed_constrained_s": p50(mixed_runs, "ttft", True),
        "load_average_end": list(os.getloadavg()),
    }
    print(f"TPOT p50 plain {plain:.4f}s, mixed {mixed:.4f}s: overhead ratio {mixed / plain:.3f} "
          f"(per round {', '.join(f'{x:.3f}' for x in data['overhead_ratio_per_round'])}); server CPU per "
          f"token ratio {data['cpu_overhead_ratio_median']:.3f}; load average "
          f"{info['load_avg_1_5_15'][0]:.1f} -> {data['load_average_end'][0]:.1f}")
    if args.out:
        write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
