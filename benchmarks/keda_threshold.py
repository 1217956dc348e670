"""The KEDA threshold on vllm:num_requests_waiting that keeps TTFT p99 under an SLO, measured on one replica.

Starts `pagedserve serve --metrics-prefix vllm --max-num-seqs S`, then runs `pagedserve bench serve` closed-loop
at each --concurrency C (C - S requests wait once the batch is full) while a thread samples the server's own
vllm:num_requests_waiting every 0.25 s. Per point: mean waiting (what KEDA sees), TTFT p50/p99, TPOT, req/s.
The threshold for an SLO is the largest mean queue whose TTFT p99 stayed under it: KEDA's AverageValue target
then adds a replica before one replica's queue grows past it.

    flock /work/wt/BENCH_LOCK -c "python benchmarks/keda_threshold.py --out benchmarks/results/keda_threshold.json"
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from common import machine_info
from serving import Server, free_port


def sample_waiting(url: str, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    while not stop.is_set():
        try:
            text = httpx.get(f"{url}/metrics", timeout=2).text
        except httpx.HTTPError:
            continue
        values = {}
        for line in text.splitlines():
            for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
                if line.startswith(name + "{"):
                    values[name] = float(line.rsplit(" ", 1)[1])
        out.append((values["vllm:num_requests_waiting"], values["vllm:num_requests_running"]))
        stop.wait(0.25)


def run_point(url: str, concurrency: int, args: argparse.Namespace) -> dict:
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    cmd = [sys.executable, "-m", "pagedserve.cli", "bench", "serve", "--base-url", url, "--concurrency",
           str(concurrency), "--num-prompts", str(args.prompts_per_slot * concurrency), "--input-len",
           args.input_len, "--output-len", str(args.output_len), "--ignore-eos", "--no-progress", "--seed", "0",
           "--out", out]
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_waiting, args=(url, stop, samples), daemon=True)
    sampler.start()
    try:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        stop.set()
        sampler.join()
    m = json.load(open(out))["runs"][0]["metrics"]
    os.unlink(out)
    busy = [s for s in samples if s[0] + s[1] > 0] or samples  # leave out the idle tail after the last request
    return {"concurrency": concurrency, "mean_waiting": sum(w for w, _ in busy) / len(busy),
            "max_waiting": max(w for w, _ in busy), "mean_running": sum(r for _, r in busy) / len(busy),
            "request_throughput": m["request_throughput"], "output_throughput": m["output_throughput"],
            "ttft_p50": m["ttft"]["p50"], "ttft_p99": m["ttft"]["p99"], "tpot_p50": m["tpot"]["p50"],
            "num_completed": m["num_completed"], "num_failed": m["num_failed"],
            "command": " ".join(["pagedserve", *cmd[3:]]).replace(out, "OUT.json")}


def threshold_for(points: list[dict], slo_s: float) -> float | None:
    ok = [p["mean_waiting"] for p in points if p["ttft_p99"] <= slo_s]
    return max(ok) if ok else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--concurrency", type=int, nargs="+", default=[2, 4, 5, 6, 8, 12])
    p.add_argument("--prompts-per-slot", type=int, default=2, help="requests per point = this x concurrency")
    p.add_argument("--input-len", default="32-64")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--slo", type=float, nargs="+", default=[1.0, 2.0, 5.0, 10.0], help="TTFT p99 targets, seconds")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port), "--metrics-prefix", "vllm",
           "--max-num-seqs", str(args.max_num_seqs), "--num-threads", str(args.num_threads),
           "--kv-cache-memory", str(256 << 20), "--max-model-len", "2048", "--uvicorn-log-level", "warning"]
    report = {"machine": machine_info(), "server": " ".join(["pagedserve", *cmd[3:]]), "points": []}
    server = Server("pagedserve", cmd, port)
    try:
        for c in args.concurrency:
            point = run_point(server.url, c, args)
            report["points"].append(point)
            print(f"C={c:3d} waiting {point['mean_waiting']:5.2f} (max {point['max_waiting']:.0f}) "
                  f"TTFT p50 {point['ttft_p50']:.3f}s p99 {point['ttft_p99']:.3f}s TPOT p50 "
                  f"{point['tpot_p50'] * 1e3:.1f}ms {point['request_throughput']:.2f} req/s", flush=True)
    finally:
        server.stop()
    report["machine"]["load_avg_1_5_15_after"] = list(os.getloadavg())
    report["thresholds"] = {f"{slo:g}": threshold_for(report["points"], slo) for slo in args.slo}
    # Little's law cross-check: at saturation a waiting request leaves the queue at the replica's request
    # rate, so W waiting add about W / rate seconds to TTFT.
    sat = max(report["points"], key=lambda q: q["request_throughput"])
    base = min(q["ttft_p99"] for q in report["points"])
    report["littles_law"] = {f"{slo:g}": max(0.0, (slo - base) * sat["request_throughput"]) for slo in args.slo}
    for slo in args.slo:
        t = report["thresholds"][f"{slo:g}"]
        print(f"TTFT p99 <= {slo:g}s: threshold {'none' if t is None else math.floor(t * 10) / 10} waiting per "
              f"replica (Little's law: {report['littles_law'][f'{slo:g}']:.1f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
