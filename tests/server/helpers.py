"""A real `pagedserve serve` in a subprocess on 127.0.0.1, and small readers for its endpoints."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

# Small settings so the whole server suite runs in a few minutes on 2 CPU cores. The offline LLM used for
# greedy comparisons is built with the same ones. One torch thread each: on a busy 2-core machine two
# spinning OpenMP threads per process made generation up to 9x slower, and equal thread counts keep the
# server's and the offline LLM's float reductions in the same order.
KV_BYTES = 96 << 20  # 2176 tokens: an explicit max_model_len must fit the pool
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 64
NUM_THREADS = 1
ENGINE_KWARGS = dict(kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                     num_threads=NUM_THREADS)
ENGINE_ARGS = ["--kv-cache-memory", str(KV_BYTES), "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", str(MAX_NUM_SEQS), "--num-threads", str(NUM_THREADS)]
STARTUP_TIMEOUT_S = 180
# The start-up warm-up (engine/warmup.py) is off in test servers: it would add seconds to each of the suite's
# ~25 server starts; test_server_flags.py's server runs it and checks what it leaves.
SERVER_ARGS = ["--no-warmup"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *extra_args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagedserve-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               *ENGINE_ARGS, *SERVER_ARGS, *extra_args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.read_log()}")

    def read_log(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


    def close(self) -> None:
        self.stop()
        self.log.close()
        os.unlink(self.log.name)


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    # {(series name, frozenset of label pairs): value} from the Prometheus text format.
    text = httpx.get(f"{url}/metrics", timeout=10).text
    series = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$", line)
        assert m, line
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        series[(m.group(1), labels)] = float(m.group(3))
    return series


def metric(series: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    values = [v for (n, ls), v in series.items() if n == name and want <= set(ls)]
    assert len(values) == 1, (name, labels, values)
    return values[0]


def wait_pool_free(url: str, prefix: str = "pagedserve", timeout: float = 10.0) -> float:
    """Poll /metrics until nothing runs or waits and the KV pool is empty; returns the seconds it took."""
    t0 = time.monotonic()
    while True:
        s = scrape(url)
        if (metric(s, f"{prefix}:num_requests_running") == 0 and metric(s, f"{prefix}:num_requests_waiting") == 0
                and metric(s, f"{prefix}:kv_cache_usage_perc") == 0.0):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"KV pool not free after {timeout}s: "
                                 f"{ {k[0]: v for k, v in s.items() if 'num_requests' in k[0] or 'kv_cache' in k[0]} }")
        time.sleep(0.02)
