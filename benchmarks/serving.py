"""Serving benchmark: pagedserve against a transformers-based server, same streamed workload, one run.

Without --base-url it starts `pagedserve serve` and benchmarks/hf_server.py (static batching over
transformers' generate-style loop, the server a team would otherwise write) on free local ports, with the
same model (the embedded SmolLM2 GGUF, fp32) and the same torch thread count, runs every load point against
both in turn (so drift in machine load hits both) and writes JSON plus a latency-vs-throughput PNG:

    python benchmarks/serving.py --out benchmarks/results/serving.json --plot benchmarks/results/serving.png

Load points: each --request-rate with each --concurrency (default: inf at concurrency 8, a closed loop),
then each --sweep-rates value as open-loop Poisson arrivals with no cap. With --base-url it measures any
OpenAI-compatible servers instead (vLLM, llama.cpp's llama-server, TensorRT-LLM behind Triton's OpenAI
frontend) with the same client; every `pagedserve bench serve` flag applies.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from common import machine_info
from pagedserve.bench.cli import add_bench_args, run_benchmark

HERE = os.path.dirname(os.path.abspath(__file__))


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, startup_timeout_s: float = 300.0) -> None:
        self.name, self.cmd, self.url = name, cmd, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} not healthy after {startup_timeout_s:.0f}s; log: {self.log.name}")
            time.sleep(0.5)
        print(f"{name} ready at {self.url} (log {self.log.name})", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(p, require_url=False)
    g = p.add_argument_group("servers started here (without --base-url)")
    g.add_argument("--sweep-rates", type=float, nargs="*", default=[0.4, 0.8, 1.6], metavar="R",
                   help="open-loop Poisson points after the --concurrency points (default 0.4 0.8 1.6 req/s)")
    g.add_argument("--num-threads", type=int, default=1, help="torch threads in each server (default 1)")
    g.add_argument("--kv-cache-memory", type=int, default=256 << 20, metavar="BYTES", help="pagedserve's KV pool")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--hf-max-batch-size", type=int, default=8)
    g.add_argument("--also", action="append", default=[], metavar="LABEL=URL",
                   help="also measure an already running OpenAI-compatible server in the same run, e.g. "
                        "llama.cpp=http://127.0.0.1:8081 (repeatable)")
    # Sized so the whole default run (8 runs of 24 requests, two server starts) takes about 10 minutes on 2 cores.
    p.set_defaults(num_prompts=24, input_len=(64, 256), output_len=(32, 64), concurrency=[8])
    args = p.parse_args()
    points = [(r, c) for c in args.concurrency for r in args.request_rate] + [(r, None) for r in args.sweep_rates]
    meta = {"machine": machine_info()}
    if args.base_url:
        return run_benchmark(args, meta, points)
    threads = ["--num-threads", str(args.num_threads)]
    specs = {
        "pagedserve": [sys.executable, "-m", "pagedserve.cli", "serve", *threads, "--kv-cache-memory",
                       str(args.kv_cache_memory), "--max-model-len", str(args.max_model_len),
                       "--uvicorn-log-level", "warning"],
        "transformers": [sys.executable, os.path.join(HERE, "hf_server.py"), *threads, "--max-batch-size",
                         str(args.hf_max_batch_size)],
    }
    servers: list[Server] = []
    try:
        for name, cmd in specs.items():
            port = free_port()
            servers.append(Server(name, [*cmd, "--port", str(port)], port))
        also = [item.split("=", 1) for item in args.also]
        if any(len(pair) != 2 for pair in also):
            p.error("--also takes LABEL=URL")
        args.base_url = [s.url for s in servers] + [url for _, url in also]
        args.label = [s.name for s in servers] + [label for label, _ in also]
        meta["servers"] = {s.name: {"command": " ".join(os.path.relpath(a) if a.endswith(".py") else a
                                                        for a in s.cmd[1:])} for s in servers}
        meta["servers"]["transformers"]["batching"] = (
            f"static: up to {args.hf_max_batch_size} waiting requests per batch, run to completion")
        meta["servers"].update({label: {"base_url": url, "started": "outside this script"} for label, url in also})
        return run_benchmark(args, meta, points)
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    sys.exit(main())
