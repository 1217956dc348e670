"""Structured outputs overhead (issue 13): decode TPOT at 16 concurrent streams when half of them decode under
a JSON schema, against the same 16 streams with no constraint. Target: < 10% overhead.

Every stream asks for the same number of tokens; the schema (an array of exactly N hourly rows) is longer
than that, so constrained streams also run to max_tokens and both runs decode the same token counts. Runs
alternate (plain, mixed, plain, mixed, ...) on one server, so machine noise hits both alike.

    flock /work/wt/BENCH_LOCK -c "python benchmarks/structured.py --out benchmarks/results/structured.json"
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import httpx

from common import machine_info, write_json
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


async def stream_one(client: httpx.AsyncClient, max_tokens: int, schema: dict | None) -> dict:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "visitors", "schema": schema}}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return {"constrained": schema is not None, "tokens": tokens, "ttft": (first or end) - t0,
            "tpot": (end - first) / (tokens - 1) if first and tokens > 1 else None}


async def run(url: str, schemas: list[dict | None], max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        return await asyncio.gather(*(stream_one(client, max_tokens, s) for s in schemas))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="plain/mixed pairs")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    info = machine_info()
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port), "--max-model-len", "2048",
           "--kv-cache-memory", str(256 << 20), "--max-num-seqs", str(args.streams), "--uvicorn-log-level", "warning",
           "--structured-outputs-compile-timeout", "120"]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    server = Server("pagedserve", cmd, port)
    plain_runs, mixed_runs = [], []
    try:
        asyncio.run(run(server.url, [None, hourly_schema(-1)], 8))  # warm-up (and the xgrammar tokenizer info)
        for r in range(args.rounds):
            plain_runs.append(asyncio.run(run(server.url, [None] * args.streams, args.max_tokens)))
            # Fresh schemas each round: their compiles overlap the other streams' decoding.
            schemas = [hourly_schema(100 * r + i) if i % 2 else None for i in range(args.streams)]
            mixed_runs.append(asyncio.run(run(server.url, schemas, args.max_tokens)))
            print(f"round {r}: done", file=sys.stderr, flush=True)
    finally:
        server.stop()

    def p50(results, constrained=None) -> float:
        return statistics.median(x["tpot"] for rs in results for x in rs
                                 if x["tpot"] is not None and (constrained is None or x["constrained"] == constrained))

    assert all(x["tokens"] == args.max_tokens for rs in plain_runs + mixed_runs for x in rs)
    plain, mixed = p50(plain_runs), p50(mixed_runs)
    per_round = [p50([m]) / p50([q]) for q, m in zip(plain_runs, mixed_runs)]
    data = {
        "machine": info, "command": " ".join(sys.argv),
        "config": {"streams": args.streams, "max_tokens": args.max_tokens, "rounds": args.rounds,
                   "constrained_per_mixed_run": args.streams // 2, "prompt": PROMPT, "schema": hourly_schema(0)},
        "tpot_p50_plain_s": plain, "tpot_p50_mixed_s": mixed,
        "tpot_p50_mixed_constrained_streams_s": p50(mixed_runs, True),
        "tpot_p50_mixed_free_streams_s": p50(mixed_runs, False),
        "overhead_ratio": mixed / plain, "overhead_ratio_per_round": per_round,
        "ttft_p50_plain_s": statistics.median(x["ttft"] for rs in plain_runs for x in rs),
        "ttft_p50_mixed_constrained_s": statistics.median(x["ttft"] for rs in mixed_runs for x in rs
                                                          if x["constrained"]),
        "load_average_end": list(os.getloadavg()),
    }
    print(json.dumps({k: v for k, v in data.items() if k not in ("machine", "config")}, indent=1))
    if args.out:
        write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
