"""Where the resident memory of `pagedserve serve` goes (issue 11: <= 450 MB with a 100 MB KV pool).

Two measurements, each in a fresh process:
  stages  one child process walks the server's start-up by hand and reads /proc/self/status after each
          step: the interpreter, `import torch` alone (the floor no serving code can go under), the serving
          imports, the weights (load_model), the KV pool, a warmup (a 256-token prefill in chunks of 64,
          then 16 single-token decode steps, the two matmul paths), and the KV pool with every page written
          (the worst case: the pool's pages become resident when first written). RSS splits into anonymous
          memory (heap, weights, KV) and file-backed pages (shared libraries, mapped files); VmHWM is the peak.
  server  the real `pagedserve serve --kv-cache-memory 100000000` after /health answers, then after a few
          completion requests (the number issue 11 sets the target for).

    python benchmarks/memory.py [--model PATH] [--dtype float32|auto|bfloat16] [--server-only]
                                [--out benchmarks/results/memory.json]

--dtype is the server's --dtype (auto: what this CPU resolves it to); the stage process uses the same dtype.
--server-only skips the stage process, which would otherwise fill the cache ($PAGEDSERVE_CACHE_DIR: the
converted GGUF metadata, resolved configs) before the server starts: with those entries removed, the server
measures a first start.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, stop_process, write_json  # noqa: E402

KV_BYTES = 100_000_000
_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def read_status(pid: int | str = "self") -> dict[str, float]:
    # MB (10^6 bytes) of each field; /proc reports kB (KiB).
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        text = f.read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) * 1024 / 1e6 for k in _FIELDS}


def run_stages(model: str | None, dtype_name: str) -> list[dict]:
    # In this (child) process: record memory after each start-up step.
    stages = [{"stage": "python", **read_status()}]
    import torch

    stages.append({"stage": "import torch", **read_status()})
    import pagedserve.engine.async_engine  # noqa: F401
    import pagedserve.server.app  # noqa: F401

    stages.append({"stage": "serving imports", **read_status()})
    from pagedserve.config import CacheConfig
    from pagedserve.model.dtypes import resolve_dtype
    from pagedserve.model.loader import load_model
    from pagedserve.quality import greedy_continuation
    from pagedserve.kv_spec import kv_cache_spec
    from pagedserve.worker.kv_cache import allocate
    from pagedserve.worker.memory import plan_num_blocks

    dtype, _ = resolve_dtype(dtype_name, torch.device("cpu"))
    loaded = load_model(model, dtype=dtype, quantization=None)
    stages.append({"stage": f"weights ({str(dtype).removeprefix('torch.')}, {loaded.quantization})",
                   **read_status()})
    m, hf = loaded.model, loaded.hf_config
    cache = CacheConfig(block_size=16, kv_cache_memory_bytes=KV_BYTES)
    spec = kv_cache_spec(hf, cache.block_size, str(dtype).removeprefix("torch."))
    num_blocks = plan_num_blocks(cache, spec.bytes_per_block, KV_BYTES)
    caches = allocate(spec, num_blocks, torch.device("cpu"))
    stages.append({"stage": f"KV pool ({num_blocks} blocks)", **read_status()})
    ids = list(range(1000, 1256))
    greedy_continuation(m, ids, caches, 16, max_tokens=16, chunk=64)  # prefill (> 8 rows), then decode (1 row)
    stages.append({"stage": "warmup", **read_status()})
    for c in caches:  # every KV page written, as under full load (the pool's pages commit on first write)
        c.view(torch.uint8).fill_(0)
    stages.append({"stage": "KV pool fully written", **read_status()})
    return stages


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_server(model: str | None, dtype_name: str, timeout_s: float = 600.0) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port), "--kv-cache-memory", str(KV_BYTES),
           "--dtype", dtype_name]
    if model:
        cmd[4:4] = ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy")
            time.sleep(0.5)
        started = read_status(proc.pid)
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            name = json.load(r)["data"][0]["id"]
        for prompt_words, max_tokens in ((200, 32), (10, 32)):
            body = json.dumps({"model": name, "prompt": "the quick brown fox " * (prompt_words // 4),
                               "max_tokens": max_tokens, "temperature": 0}).encode()
            req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                json.load(r)
        served = read_status(proc.pid)
        return {"command": " ".join(cmd[1:]), "after_start": started, "after_requests": served}
    finally:
        stop_process(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded model)")
    p.add_argument("--dtype", default="float32", help="the server's --dtype (default float32)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "memory.json"))
    p.add_argument("--server-only", action="store_true", help="measure the server alone (see above)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_stages(args.model, args.dtype)))
        return
    child = [sys.executable, os.path.abspath(__file__), "--child", "--dtype", args.dtype]
    child += ["--model", args.model] if args.model else []
    stages = [] if args.server_only else json.loads(
        subprocess.run(child, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    server = measure_server(args.model, args.dtype)
    result = {"machine": machine_info(), "dtype": args.dtype,
              "env": {k: os.environ.get(k) for k in ("MALLOC_ARENA_MAX",)}, "stages_mb": stages, "server_mb": server}
    for s in stages:
        print(f"{s['stage']:<28} RSS {s['VmRSS']:7.1f}  anon {s['RssAnon']:7.1f}  file {s['RssFile']:6.1f}  "
              f"peak {s['VmHWM']:7.1f} MB")
    for k in ("after_start", "after_requests"):
        s = server[k]
        print(f"server {k:<21} RSS {s['VmRSS']:7.1f}  anon {s['RssAnon']:7.1f}  file {s['RssFile']:6.1f}  "
              f"peak {s['VmHWM']:7.1f} MB")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
