"""Latency of one gloo all-reduce over loopback: the fixed cost (alpha) each of a TP step's 2L + 2
collectives pays on a CPU host. Two ranks, message sizes of the embedded model's all-reduces.

Usage: flock /work/wt/BENCH_LOCK -c "python benchmarks/tp_allreduce.py --json benchmarks/results/tp_allreduce.json"
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [576, 576 * 8, 576 * 64, 49152]  # floats: 1, 8, 64 tokens of hidden 576; one row of logits
ITERS = 300


def _rank(rank: int, world: int, port: int, out) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = {}
    for n in SIZES:
        x = torch.ones(n)
        for _ in range(20):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(ITERS):
            dist.all_reduce(x)
        result[n] = (time.perf_counter() - t0) / ITERS * 1e6
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world_size, port, q)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    result = q.get()
    for p in procs:
        p.join()
    rows = [{"floats": n, "bytes": 4 * n, "us_per_allreduce": round(us, 1)} for n, us in result.items()]
    for r in rows:
        print(f"{r['bytes']:>8} B  {r['us_per_allreduce']:8.1f} us")
    info = {"world_size": args.world_size, "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(), "torch": torch.__version__, "rows": rows}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
