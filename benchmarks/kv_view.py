"""What keeping the KV dashboard open costs (issue 15), measured in one run on one server:

Output tokens/s of `pagedserve serve` at 16 concurrent streams (throughput.py's 64-request workload, client in
this process) with nobody watching, against the same while a poller reads GET /debug/kv as the page does
(every --poll-ms, each reply parsed as JSON). Rounds alternate (off, on, off, on, ...) so drift on a shared
machine hits both sides; the ratio is of the summed tokens over the summed wall time. With --browser, one more
pair of rounds runs with the real page open in headless Chromium on the same machine (its rendering then
competes for the same cores, which a remote operator's browser would not). Target: on/off >= 0.98.

Also: the cost of one snapshot on a full pool of the server's size, split into the engine-thread copy and the
JSON written off the engine thread.

    flock /work/wt/BENCH_LOCK -c "python benchmarks/kv_view.py --out benchmarks/results/kv_view.json"
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import threading
import time

import httpx

from common import describe_workload, machine_info, synthetic_requests, write_json
from engine_core import run_streams
from serving import Server, free_port


class Poller:
    """Reads /debug/kv every interval on its own thread, like the dashboard page."""

    def __init__(self, url: str, interval_s: float) -> None:
        self.url, self.interval_s = url, interval_s
        self.stop = threading.Event()
        self.num_polls = 0
        self.seqs: set[int] = set()
        self.bytes = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.wait(self.interval_s):
                resp = client.get("/debug/kv")
                resp.raise_for_status()
                snap = json.loads(resp.content)
                self.num_polls += 1
                self.seqs.add(snap["seq"])
                self.bytes += len(resp.content)

    def close(self) -> dict:
        self.stop.set()
        self.thread.join(30)
        return {"num_polls": self.num_polls, "num_distinct_snapshots": len(self.seqs),
                "mean_body_bytes": self.bytes / max(self.num_polls, 1)}


class BrowserPage:
    """The dashboard in headless Chromium (Debian's chromium + chromedriver, driven by selenium)."""

    def __init__(self, url: str) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium")
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
            options.add_argument(flag)
        self.driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        self.driver.get(f"{url}/dashboard")

    def close(self) -> dict:
        updates = self.driver.execute_script("return Number(document.body.dataset.updates || 0)")
        self.driver.quit()
        return {"page_updates": updates}


def snapshot_cost(num_blocks: int, block_size: int, repeats: int = 20) -> dict:
    # A full pool: 64 requests holding every block, as under heavy load (the most a snapshot has to say).
    from pagedserve.config import SchedulerConfig
    from pagedserve.core.kv_cache_manager import KVCacheManager
    from pagedserve.core.kv_snapshot import capture_kv_state, kv_snapshot_json
    from pagedserve.core.request import Request
    from pagedserve.core.scheduler import Scheduler
    from pagedserve.sampling_params import SamplingParams

    kv = KVCacheManager(num_blocks, block_size, True)
    sched = Scheduler(SchedulerConfig(64, 1 << 30), kv, num_blocks * block_size)
    per_req = num_blocks * block_size // 64 - block_size
    for i in range(64):
        req = Request(f"cmpl-{i:032x}-0", [1000 * i + j for j in range(per_req)],
                      SamplingParams(max_tokens=1), 1, (2,))
        sched.add_request(req)
        sched.schedule()  # one at a time: all admitted, their blocks allocated
    t0 = time.perf_counter()
    for _ in range(repeats):
        state = capture_kv_state(sched)
    t1 = time.perf_counter()
    for _ in range(repeats):
        body = kv_snapshot_json(state)
    t2 = time.perf_counter()
    return {"num_blocks": num_blocks, "blocks_in_use": num_blocks - kv.pool.num_free_blocks,
            "engine_thread_capture_ms": (t1 - t0) / repeats * 1e3, "json_ms": (t2 - t1) / repeats * 1e3,
            "body_bytes": len(body)}


def measure(url: str, reqs, streams: int, watcher) -> dict:
    watching = watcher() if watcher is not None else None
    try:
        wall, results = asyncio.run(run_streams(url, reqs, streams))
    finally:
        watched = watching.close() if watching is not None else {}
    tokens = sum(r["tokens"] for r in results)
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_per_s": tokens / wall, **watched}


def ratio(on: list[dict], off: list[dict]) -> float:
    def rate(rounds):
        return sum(r["output_tokens"] for r in rounds) / sum(r["wall_s"] for r in rounds)
    return rate(on) / rate(off)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=2 << 30)
    # One thread: on a shared 2-core machine a two-thread OpenMP team stalls whenever another process takes a
    # core, which swamps the effect measured here.
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="pairs of (off, on) rounds")
    p.add_argument("--poll-ms", type=int, default=500, help="the page's default interval")
    p.add_argument("--browser", action="store_true", help="one more pair with the page open in Chromium")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    info = machine_info()

    # Plain-text token ids of the embedded model (no specials below 300 or above its 49,152-token vocab);
    # loading a model here only for its tokenizer would cost a minute of a shared machine.
    ids = list(range(300, 20000))
    reqs = synthetic_requests(args.num_prompts, tuple(args.input_len), tuple(args.output_len), ids, seed=0)
    port = free_port()
    server = Server("pagedserve", [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port),
                                   "--max-model-len", str(args.max_model_len), "--kv-cache-memory",
                                   str(args.kv_cache_memory), "--max-num-seqs", str(args.max_num_seqs),
                                   "--num-threads", str(args.num_threads), "--uvicorn-log-level", "warning"], port)
    poller = lambda: Poller(server.url, args.poll_ms / 1e3)  # noqa: E731
    rounds = {"off": [], "on": [], "browser_off": [], "browser_on": []}
    try:
        snap = httpx.get(f"{server.url}/debug/kv", timeout=30).json()
        asyncio.run(run_streams(server.url, reqs[:2], 2))  # warm-up
        for i in range(args.rounds):
            for name, watcher in (("off", None), ("on", poller)) if i % 2 == 0 else (("on", poller), ("off", None)):
                rounds[name].append(r := measure(server.url, reqs, args.max_num_seqs, watcher))
                print(f"round {i} {name}: {r['output_tok_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
        if args.browser:
            for name, watcher in (("browser_off", None), ("browser_on", lambda: BrowserPage(server.url))):
                rounds[name].append(r := measure(server.url, reqs, args.max_num_seqs, watcher))
                print(f"{name}: {r['output_tok_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        server.stop()
    cost = snapshot_cost(snap["num_blocks"], snap["block_size"])
    data = {
        "machine": info, "command": " ".join(sys.argv),
        "config": {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
                   "kv_cache_memory_bytes": args.kv_cache_memory, "num_kv_blocks": snap["num_blocks"],
                   "num_threads": args.num_threads,
                   "poll_ms": args.poll_ms},
        "workload": describe_workload(reqs, input_len="%d-%d" % tuple(args.input_len),
                                      output_len="%d-%d" % tuple(args.output_len), greedy=True, ignore_eos=True),
        "rounds": {k: v for k, v in rounds.items() if v},
        "ratio_on_over_off": ratio(rounds["on"], rounds["off"]),
        "snapshot_cost_full_pool": cost,
        "load_average_end": list(os.getloadavg()),
    }
    if args.browser:
        data["ratio_browser_on_over_off"] = ratio(rounds["browser_on"], rounds["browser_off"])
    print(json.dumps({k: v for k, v in data.items() if k.startswith("ratio") or k == "snapshot_cost_full_pool"},
                     indent=1))
    if args.out:
        write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
