"""Speed, resident memory and accuracy of every numeric mode (dtype x quantization x KV cache dtype), one plot.

    python benchmarks/modes.py --out benchmarks/results/modes.json --plot benchmarks/results/modes.png

Perplexity comes from benchmarks/quality.py's results (results/quality.json, the same modes); this script
measures the other two axes. Each mode runs in a fresh process (so resident memory is that mode's alone):
load the embedded model with `LLM(dtype=..., quantization=..., kv_cache_dtype=...)`, one untimed warm-up
request, then a short offline workload (random token ids, greedy, eos ignored) timed as output tokens per
second of wall time. Resident memory is the process's VmRSS after the run and its peak (VmHWM), which
includes the load (the GGUF goes through fp32 on its way to blocks). The KV pool is a fixed byte budget in
every mode (--kv-cache-memory), so an 8-bit cache shows up as more tokens in the pool, not fewer bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import machine_info, write_json  # noqa: E402

MARK = "MODE_RESULT "


def _status_mb(key: str) -> float:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"{key} not in /proc/self/status")


def run_one(args: argparse.Namespace) -> dict:
    # In the child process: one mode, one workload.
    from common import allowed_token_ids, synthetic_requests

    from pagedserve import LLM, SamplingParams
    from pagedserve.model import loader

    # int8 weights quantize a float checkpoint: the GGUF's converted Hugging Face directory (as quality.py).
    model = loader.resolve_model_dir(None)[0] if args.quantization == "int8" else None
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              kv_cache_memory_bytes=args.kv_cache_memory, max_model_len=args.max_model_len,
              max_num_seqs=args.num_prompts, num_threads=args.num_threads)
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    reqs = synthetic_requests(args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                              allowed_token_ids(llm.get_tokenizer(), engine.hf_config.vocab_size), args.seed)
    llm.generate([{"prompt_token_ids": reqs[0].prompt_token_ids[:16]}], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"load_s": load_s, "wall_s": wall, "cpu_s": cpu, "output_tokens": num_out,
            "prompt_tokens": sum(r.num_prompt_tokens for r in reqs),
            "output_tokens_per_s": num_out / wall, "output_tokens_per_cpu_s": num_out / cpu,
            "rss_mb": _status_mb("VmRSS"), "peak_rss_mb": _status_mb("VmHWM"),
            "kv_capacity_tokens": engine.kv.num_blocks * engine.kv.block_size,
            "resolved_quantization": getattr(engine.config.model, "quantization", None)}


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, key) = plt.subplots(1, 2, figsize=(13, 6), width_ratios=[2.2, 1], constrained_layout=True)
    ppl = [r["perplexity"] for r in rows]
    sc = ax.scatter([r["rss_mb"] for r in rows], [r["output_tokens_per_s"] for r in rows], c=ppl, cmap="viridis_r",
                    s=140, edgecolors="black", vmin=min(ppl), vmax=max(ppl))
    # Points of similar modes sit on top of each other: numbers on the points, the modes in a key beside.
    for i, r in enumerate(rows, 1):
        ax.annotate(str(i), (r["rss_mb"], r["output_tokens_per_s"]), textcoords="offset points",
                    xytext=(6 + 9 * (i % 2), 3 - 6 * (i % 3)), fontsize=9, weight="bold")
    fig.colorbar(sc, ax=ax, label="perplexity on benchmarks/data/heldout.txt (lower is better)")
    ax.set_xlabel("resident memory after the run, VmRSS (MB)")
    ax.set_ylabel("offline output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.margins(x=0.15, y=0.15)
    key.axis("off")
    lines = ["    dtype / weights / KV cache          tok/s   MB    ppl"]
    lines += [f"{i:>2}  {mode_label(r):<34}{r['output_tokens_per_s']:6.1f} {r['rss_mb']:5.0f}  "
              f"{r['perplexity']:.2f} ({r['perplexity_change']:+.2%})" for i, r in enumerate(rows, 1)]
    key.text(0, 1, "\n".join(lines), va="top", family="monospace", fontsize=7.5, transform=key.transAxes)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mode_label(r: dict) -> str:
    return f"{r['dtype']} / {r['quantization']} / KV {r['kv_cache_dtype']}"


def plot_title(machine: dict, num_prompts: int) -> str:
    return (f"embedded SmolLM2-135M Q4_1, {num_prompts} requests offline, {machine['cpu_model']} "
            f"({machine['cpu_count']} CPUs), load avg {machine['load_avg_1_5_15'][0]:.1f} -> "
            f"{machine['load_avg_1_5_15_at_end'][0]:.1f}")


def save(args: argparse.Namespace, machine: dict, quality: dict, rows: list[dict]) -> None:
    machine["load_avg_1_5_15_at_end"] = list(os.getloadavg())
    result = {"machine": machine, "perplexity_from": {"file": os.path.relpath(args.quality, HERE),
                                                      "machine": quality["machine"]},
              "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                           "output_len": args.output_len, "seed": args.seed,
                           "prompts": "uniform random token ids excluding special tokens",
                           "sampling": "greedy, ignore_eos", "kv_cache_memory_bytes": args.kv_cache_memory,
                           "max_model_len": args.max_model_len, "num_threads": args.num_threads},
              "modes": rows}
    if args.out:
        write_json(args.out, result)
    if args.plot:
        plot(rows, args.plot, plot_title(machine, args.num_prompts))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quality", default=os.path.join(HERE, "results", "quality.json"),
                   help="quality.py's JSON: the modes and their perplexity")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, nargs=2, default=[64, 128], metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 32], metavar=("LO", "HI"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", type=int, default=100_000_000, metavar="BYTES")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--out", default=None, metavar="FILE.json")
    p.add_argument("--plot", default=None, metavar="FILE.png")
    p.add_argument("--replot", action="store_true", help="only redraw --plot from the rows in --out")
    p.add_argument("--one", nargs=3, default=None, metavar=("DTYPE", "QUANTIZATION", "KV"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        args.dtype, args.quantization, args.kv_cache_dtype = args.one
        print(MARK + json.dumps(run_one(args)), flush=True)
        return 0
    if args.replot:
        with open(args.out, encoding="utf-8") as f:
            saved = json.load(f)
        plot(saved["modes"], args.plot, plot_title(saved["machine"], saved["workload"]["num_prompts"]))
        return 0
    # SIGTERM (e.g. from `timeout`) unwinds, so subprocess.run ends the running mode's process too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with open(args.quality, encoding="utf-8") as f:
        quality = json.load(f)
    machine = machine_info()
    child_args = ["--num-prompts", str(args.num_prompts), "--input-len", *map(str, args.input_len), "--output-len",
                  *map(str, args.output_len), "--seed", str(args.seed), "--max-model-len", str(args.max_model_len),
                  "--kv-cache-memory", str(args.kv_cache_memory),
                  *(["--num-threads", str(args.num_threads)] if args.num_threads else [])]
    rows = []
    for q in quality["modes"]:
        mode = [q["dtype"], q["quantization"], q["kv_cache_dtype"]]
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", *mode, *child_args],
                              capture_output=True, text=True)
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
        if proc.returncode or not found:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise RuntimeError(f"mode {mode} failed with exit code {proc.returncode}")
        row = {k: q[k] for k in ("dtype", "quantization", "kv_cache_dtype", "perplexity", "perplexity_change",
                                 "mean_kl", "weight_bytes", "kv_bytes_per_token")}
        row.update(json.loads(found[-1][len(MARK):]))
        rows.append(row)
        print(f"{mode_label(row):>40}: {row['output_tokens_per_s']:6.1f} tok/s, RSS {row['rss_mb']:5.0f} MB "
              f"(peak {row['peak_rss_mb']:5.0f}), ppl {row['perplexity']:.3f}", flush=True)
        save(args, machine, quality, rows)  # after every mode, so a run cut short still leaves its numbers
    return 0


if __name__ == "__main__":
    sys.exit(main())
