"""Does the server's resident memory stay near its start-up figure? (issue 26: within 50 MB over 2,000 requests)

Starts `pagedserve serve` (the embedded model, a 100 MB KV pool, prefaulted by default), reads its VmRSS once
/health answers, then sends a mix of requests from a few concurrent clients and reads VmRSS after every 100
(--sample-every):

    i % 10 == 0  structured output, a JSON schema of its own (200 distinct schemas in 2,000 requests)
    i % 10 == 1  chat completion             i % 10 == 2  streamed completion, abandoned after its first chunk
    i % 10 == 3  n=2 sampled, logprobs=2     i % 10 == 4  streamed chat completion
    otherwise    a completion, 5-400 words of prompt (distinct prompts: the prefix cache keeps evicting)

The grammar cache is bounded by bytes (StructuredOutputsConfig.cache_memory_bytes), so it can hold part of the
growth by design; the result lists VmRSS, RssAnon and the peak (VmHWM) at every sample, and the grammar compile
processes' memory (compile_worker.py: a zygote and a process per grammar thread, which share most of their pages)
as the sum of their PSS and of their USS (smaps_rollup: PSS splits each shared page among its processes, USS
counts only private ones), `children_pss` / `children_uss`; `total_pss` is the server's PSS plus theirs.

    python benchmarks/memory_soak.py [--num-requests 2000] [--concurrency 8] [--model PATH]
                                     [--out benchmarks/results/memory_soak.json] [-- extra serve flags]

Needs a quiet machine only for its duration; memory figures do not depend on load, but 2,000 requests take a
few minutes on 2 free cores.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, stop_process, write_json  # noqa: E402
from memory import _free_port, read_status  # noqa: E402

KV_BYTES = 100_000_000
NUM_SCHEMAS = 200
WORDS = ("river stone lantern quiet harbor meadow copper violet engine ledger orbit canyon willow signal "
         "parcel marble thunder pocket garden silver window ticket falcon rocket pepper anchor").split()


def schema(i: int) -> dict:
    # Distinct in its property names, bounds and enum values, so each compiles on its own.
    return {"type": "object", "properties": {
        f"item_{i}": {"type": "string", "enum": [f"{w}_{i}" for w in WORDS[i % 7:i % 7 + 6]]},
        f"count_{i}": {"type": "integer", "minimum": i, "maximum": 1000 + i},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8 + i % 5}, "maxItems": 3}},
        "required": [f"item_{i}", f"count_{i}"]}


def smaps_mb(pid: int) -> tuple[float, float]:
    """(PSS, USS) of one process, in MB (10^6 bytes)."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup", encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024 / 1e6
    return fields["Pss"], fields["Private_Clean"] + fields["Private_Dirty"]


def tree_memory(pid: int) -> dict[str, float]:
    # The server's PSS and its descendants' (the grammar compile processes) PSS and USS sums.
    import psutil

    children = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            children.append(smaps_mb(child.pid))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass  # gone meanwhile
    own_pss = smaps_mb(pid)[0]
    child_pss = sum(p for p, _ in children)
    return {"children": len(children), "children_pss": round(child_pss, 1),
            "children_uss": round(sum(u for _, u in children), 1), "total_pss": round(own_pss + child_pss, 1)}


def memory_status(pid: int) -> dict[str, float]:
    return {**read_status(pid), **tree_memory(pid)}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def request(i: int, rng: random.Random) -> tuple[str, dict, bool]:
    """(path, body, abandon after the first chunk)."""
    kind = i % 10
    chat = {"messages": [{"role": "user", "content": words(rng, rng.randint(5, 80))}], "max_tokens": 16}
    if kind == 0:
        s = schema(i // 10 % NUM_SCHEMAS)
        return "/v1/chat/completions", {**chat, "max_tokens": 24, "response_format": {
            "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s}}}, False
    if kind == 1:
        return "/v1/chat/completions", {**chat, "temperature": 0.7, "seed": i}, False
    if kind == 4:
        return "/v1/chat/completions", {**chat, "stream": True}, False
    body = {"prompt": words(rng, rng.randint(5, 400)), "max_tokens": rng.randint(1, 24)}
    if kind == 2:
        return "/v1/completions", {**body, "stream": True, "max_tokens": 64}, True
    if kind == 3:
        return "/v1/completions", {**body, "n": 2, "temperature": 0.8, "logprobs": 2}, False
    return "/v1/completions", body, False


async def send(client: httpx.AsyncClient, path: str, body: dict, abandon: bool) -> tuple[int, str]:
    if not body.get("stream"):
        resp = await client.post(path, json=body)
        return resp.status_code, "" if resp.status_code == 200 else resp.text[:300]
    async with client.stream("POST", path, json=body) as resp:
        async for line in resp.aiter_lines():
            if abandon or '"error"' in line:
                break  # abandon: the client goes away mid-stream, and the server aborts the request
        return resp.status_code, line[:300] if '"error"' in line else ""


async def soak(url: str, pid: int, num_requests: int, concurrency: int, kinds: set[int],
               sample_every: int) -> tuple[list[dict], dict[int, int], list[str]]:
    rng = random.Random(0)
    todo = [request(i, rng) for i in range(num_requests * 10) if i % 10 in kinds][:num_requests]
    samples: list[dict] = []
    statuses: dict[int, int] = {}
    errors: list[str] = []
    done = 0
    next_index = 0
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def worker() -> None:
            nonlocal done, next_index
            while next_index < len(todo):
                path, body, abandon = todo[next_index]
                next_index += 1
                status, error = await send(client, path, body, abandon)
                statuses[status] = statuses.get(status, 0) + 1
                if (status != 200 or error) and len(errors) < 10:
                    errors.append(f"{status} {path}: {error}")
                done += 1
                if done % sample_every == 0:
                    samples.append({"requests": done, "seconds": round(time.monotonic() - t0, 1),
                                    **memory_status(pid)})
                    print(f"{done:5d} requests  RSS {samples[-1]['VmRSS']:7.1f} MB  anon {samples[-1]['RssAnon']:7.1f}"
                          f"  peak {samples[-1]['VmHWM']:7.1f}  compile processes {samples[-1]['children']}: PSS "
                          f"{samples[-1]['children_pss']:5.1f} USS {samples[-1]['children_uss']:5.1f}  total PSS "
                          f"{samples[-1]['total_pss']:7.1f}", flush=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, statuses, errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--model", default=None)
    p.add_argument("--sample-every", type=int, default=100, help="read VmRSS after every this many requests")
    p.add_argument("--kinds", default="0,1,2,3,4,5,6,7,8,9", help="which of the request kinds above to send")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "memory_soak.json"))
    p.add_argument("serve_args", nargs="*", help="extra `pagedserve serve` flags (after --)")
    args = p.parse_args()
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port), "--kv-cache-memory", str(KV_BYTES),
           *(["--model", args.model] if args.model else []), *args.serve_args]
    log_path = args.out + ".server.log"
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited; see {log_path}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy")
            time.sleep(0.5)
        start = memory_status(proc.pid)
        print(f"start          RSS {start['VmRSS']:7.1f} MB  anon {start['RssAnon']:7.1f}  compile processes "
              f"{start['children']}: PSS {start['children_pss']:5.1f} USS {start['children_uss']:5.1f}  total PSS "
              f"{start['total_pss']:7.1f}", flush=True)
        kinds = {int(k) for k in args.kinds.split(",")}
        samples, statuses, errors = asyncio.run(soak(url, proc.pid, args.num_requests, args.concurrency, kinds,
                                                     args.sample_every))
    finally:
        stop_process(proc)
    with open(log_path, encoding="utf-8") as f:
        memory_line = next((line.strip() for line in f if "memory: model" in line), None)
    final = samples[-1] if samples else start
    result = {"machine": machine_info(), "load_average": os.getloadavg(), "command": " ".join(cmd[1:]),
              "num_requests": args.num_requests, "concurrency": args.concurrency, "num_schemas": NUM_SCHEMAS,
              "kinds": args.kinds, "statuses": statuses, "errors": errors, "start_up_log": memory_line, "start_mb": start, "samples_mb": samples,
              "growth_mb": round(final["VmRSS"] - start["VmRSS"], 1),
              "max_growth_mb": round(max(s["VmRSS"] for s in samples or [start]) - start["VmRSS"], 1),
              "total_pss_growth_mb": round(final["total_pss"] - start["total_pss"], 1),
              "max_total_pss_growth_mb": round(max(s["total_pss"] for s in samples or [start]) - start["total_pss"], 1)}
    print(f"growth over {args.num_requests} requests: {result['growth_mb']} MB (max {result['max_growth_mb']} MB); "
          f"with the compile processes (total PSS) {result['total_pss_growth_mb']} MB "
          f"(max {result['max_total_pss_growth_mb']} MB); statuses {statuses} {errors[:3]}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
