"""The prefix cache's disk tier: TTFT of a known 1,000-token system prompt recomputed, from the pool, and from disk
after a restart; and throughput with no reuse at all, disk tier on vs off (issue 29's targets).

    python benchmarks/kv_offload.py                 # both cases, results/kv_offload.json
    python benchmarks/kv_offload.py --case ttft --trials 5

ttft: engine A (disk tier on) serves system prompt P_i + a new 20-token question three times: once cold
(recomputed, then written to disk), once more from its pool. Engine B, started afresh on the same directory
(a restarted replica), serves P_i + another question: its prefix comes from disk. Every engine is warmed up on
an unrelated prompt first. Targets: disk TTFT <= 1.5x pool TTFT, and >= 5x faster than recomputing.
noreuse: 32 unique 500-token prompts, 32 output tokens each, through an engine with the disk tier and one
without, alternating (ABAB); output tokens per second. Target: on within 3% of off. Also the process's CPU
seconds per round, the writer's CPU inside each round (its backlog also runs into the next "off" round) and
in all, with the final flush (where the tier's cost goes, less sensitive to other load).
Timings need a quiet machine (load average < 2 on its cores); the JSON records the load average.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import allowed_token_ids, machine_info, write_json  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402

FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def make_engine(args, kv_dir: str | None) -> LLM:
    llm = LLM(dtype=args.dtype, num_threads=args.num_threads, kv_cache_memory_bytes=args.kv_cache_memory,
              kv_offload_dir=kv_dir)
    llm.generate([{"prompt_token_ids": list(range(300, 340))}], FIRST, use_tqdm=False)  # warm-up
    return llm


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    [out] = llm.generate([{"prompt_token_ids": prompt}], FIRST, use_tqdm=False)
    return out.metrics.first_token_time - out.metrics.arrival_time, out.num_cached_tokens


def case_ttft(args, ids: list[int], kv_dir: str) -> dict:
    rng = random.Random(0)
    systems = [[rng.choice(ids) for _ in range(args.prefix_len)] for _ in range(args.trials)]
    question = lambda: [rng.choice(ids) for _ in range(20)]  # noqa: E731
    rows = []
    a = make_engine(args, kv_dir)
    for system in systems:
        cold, cached_cold = ttft(a, system + question())
        pool, cached_pool = ttft(a, system + question())
        rows.append({"recompute_s": cold, "pool_s": pool, "cached_tokens": [cached_cold, cached_pool]})
    a.llm_engine.core.kv.disk.flush()
    stored = a.llm_engine.core.kv.disk.snapshot()
    del a
    b = make_engine(args, kv_dir)  # the restarted replica
    for row, system in zip(rows, systems):
        row["disk_s"], cached = ttft(b, system + question())
        row["cached_tokens"].append(cached)
    loaded = b.llm_engine.core.kv.disk.snapshot()
    med = {k: statistics.median(r[k] for r in rows) for k in ("recompute_s", "pool_s", "disk_s")}
    return {"trials": rows, "median": med, "disk_over_pool": med["disk_s"] / med["pool_s"],
            "recompute_over_disk": med["recompute_s"] / med["disk_s"],
            "stored_blocks": stored.num_stored_blocks, "stored_bytes": stored.stored_bytes,
            "loaded_blocks": loaded.num_loaded_blocks, "loaded_bytes": loaded.loaded_bytes}


def case_noreuse(args, ids: list[int], kv_dir: str) -> dict:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    engines = {"off": make_engine(args, None), "on": make_engine(args, kv_dir)}
    disk = engines["on"].llm_engine.core.kv.disk
    writer: dict[str, list[float]] = {"off": [], "on": []}  # the tier's write CPU inside each round
    for rnd in range(args.rounds):
        for mode in ("off", "on") if rnd % 2 == 0 else ("on", "off"):
            rng = random.Random(f"{mode}-{rnd}")  # unique prompts every run: nothing to reuse
            prompts = [{"prompt_token_ids": [rng.choice(ids) for _ in range(500)]}
                       for _ in range(args.noreuse_prompts)]
            t0, c0, w0 = time.perf_counter(), time.process_time(), disk.stats.writer_cpu_seconds
            outs = engines[mode].generate(prompts, params, use_tqdm=False)
            rates[mode].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
            cpu[mode].append(time.process_time() - c0)
            writer[mode].append(disk.stats.writer_cpu_seconds - w0)
    disk.flush()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"output_tok_per_s": rates, "median": med, "on_over_off": med["on"] / med["off"], "process_cpu_s": cpu,
            "writer_cpu_s": disk.stats.writer_cpu_seconds, "writer_cpu_s_per_round": writer,
            "stored_blocks": disk.stats.num_stored_blocks, "dropped_stores": disk.stats.num_dropped_stores}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", choices=("ttft", "noreuse", "all"), default="all")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--noreuse-prompts", type=int, default=32)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    p.add_argument("--dir", default=None, help="the disk tier's directory (default: a fresh temporary one)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "kv_offload.json"))
    args = p.parse_args()
    kv_dir = args.dir or tempfile.mkdtemp(prefix="kv-offload-bench-")
    result = {"machine": machine_info(), "args": vars(args)}
    try:
        probe = LLM(kv_cache_memory_bytes=1 << 20)
        ids = allowed_token_ids(probe.get_tokenizer(), probe.llm_engine.hf_config.vocab_size)
        del probe
        if args.case in ("ttft", "all"):
            result["ttft"] = case_ttft(args, ids, os.path.join(kv_dir, "ttft"))
            print({k: result["ttft"][k] for k in ("median", "disk_over_pool", "recompute_over_disk")}, flush=True)
        if args.case in ("noreuse", "all"):
            result["noreuse"] = case_noreuse(args, ids, os.path.join(kv_dir, "noreuse"))
            print({k: result["noreuse"][k] for k in ("median", "on_over_off", "process_cpu_s", "writer_cpu_s",
                                                     "writer_cpu_s_per_round", "stored_blocks", "dropped_stores")},
                  flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(kv_dir, ignore_errors=True)
    result["load_avg_1_5_15_end"] = list(os.getloadavg())
    write_json(args.out, result)


if __name__ == "__main__":
    main()
