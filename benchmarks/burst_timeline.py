"""Where the TTFT tail of a closed-loop burst comes from: the engine's step timeline, offline, in CPU time.

    python benchmarks/burst_timeline.py --out benchmarks/results/burst_timeline.json

The burst64 workload of real_models.py (64 requests, prompts of 64-512 one-token words, outputs 16-256,
greedy, ignore_eos) through one LLMEngine with the server's defaults (adaptive budget, --max-num-seqs 16), sent
the way `bench serve --concurrency 16` sends them: 16 at once, then one more each time one finishes. The clock
is the process CPU time of the steps (robust on a loaded machine), wall time beside it. Per request: when it
was sent (step, clock), its TTFT, how many steps and tokens it waited for; per step: tokens, prefill tokens,
decoding rows, CPU ms. --budgets runs several budget settings (e.g. `adaptive` `2048`) in alternating rounds;
--env NAME=VALUE,... sets environment variables per setting the same way (each setting its own engine).

--shared-prefix-len N puts real_models.py's `shared` system prompt of N words before every prompt (with
`--num-prompts 32 --input-len 16-64 --output-len 64 --concurrency 8`, that workload) and turns the prefix cache
on, as the server has it. Each round draws other words after the prefix (same lengths) and the warm-up prompts
do not carry it, so each setting's round 0 finds the prefix cold and its later rounds find only the prefix cached.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_json  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.bench.dataset import parse_range, random_requests  # noqa: E402
from pagedserve.bench.metrics import percentiles  # noqa: E402
from pagedserve.config import CHUNKED_PREFILL_BATCHED_TOKENS, MIN_BATCHED_TOKENS  # noqa: E402


def parse_budget(text: str) -> tuple[int, int]:
    return (MIN_BATCHED_TOKENS, CHUNKED_PREFILL_BATCHED_TOKENS) if text == "adaptive" else parse_range(text)


def run_closed_loop(llm: LLM, prompts: list[tuple[str, int]], concurrency: int) -> dict:
    eng = llm.llm_engine
    sched = eng.core.scheduler
    plans = []
    schedule = sched.schedule

    def recording_schedule():
        plan = schedule()
        num_decoding = sum(1 for rid, n in plan.num_scheduled_tokens.items()
                           if n == 1 and sched.requests[rid].output_token_ids)
        plans.append((dict(plan.num_scheduled_tokens), num_decoding))
        return plan

    sched.schedule = recording_schedule
    reqs, queue, inflight = {}, list(enumerate(prompts)), set()
    clock = wall = 0.0
    steps = []

    def send():
        while queue and len(inflight) < concurrency:
            i, (text, n_out) = queue.pop(0)
            rid = f"b{i}"
            eng.add_request(rid, text, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
            reqs[rid] = {"index": i, "sent_step": len(steps), "sent_clock": clock, "sent_wall": wall,
                         "max_tokens": n_out, "token_clocks": [], "token_walls": []}
            inflight.add(rid)

    send()
    try:
        while inflight:
            c0, w0 = time.process_time(), time.perf_counter()
            outs = eng.step()
            clock += time.process_time() - c0
            wall += time.perf_counter() - w0
            if plans and len(plans) > len(steps):
                tokens, num_decoding = plans[-1]
                steps.append({"tokens": sum(tokens.values()), "num_decoding": num_decoding,
                              "prefill_tokens": sum(tokens.values()) - num_decoding,
                              "num_rows": len(tokens), "cpu_ms": 1e3 * (clock - (steps[-1]["end_clock"] if steps
                                                                                  else 0.0)),
                              "end_clock": clock})
            for out in outs:
                r = reqs[out.request_id]
                n = len(out.outputs[0].token_ids)
                r["token_clocks"] += [clock] * (n - len(r["token_clocks"]))
                r["token_walls"] += [wall] * (n - len(r["token_walls"]))
                if "prompt_len" not in r:
                    r["prompt_len"] = len(out.prompt_token_ids)
                if r["token_clocks"] and "first_step" not in r:
                    r["first_step"] = len(steps) - 1
                if out.finished:
                    inflight.discard(out.request_id)
            send()
    finally:
        sched.schedule = schedule
    rows = []
    for rid, r in reqs.items():
        ttft = r["token_clocks"][0] - r["sent_clock"]
        n = len(r["token_clocks"])
        waited = steps[r["sent_step"]:r["first_step"] + 1]
        rows.append({"req_id": rid, "index": r["index"], "prompt_len": r["prompt_len"], "output_len": n,
                     "sent_step": r["sent_step"], "first_step": r["first_step"], "ttft_cpu_s": ttft,
                     "ttft_wall_s": r["token_walls"][0] - r["sent_wall"],
                     "waited_steps": len(waited), "waited_tokens": sum(s["tokens"] for s in waited),
                     "tpot_cpu_s": (r["token_clocks"][-1] - r["token_clocks"][0]) / (n - 1) if n > 1 else None})
    ttfts = [r["ttft_cpu_s"] for r in rows]
    tpots = [r["tpot_cpu_s"] for r in rows if r["tpot_cpu_s"] is not None]
    out_tokens = sum(r["output_len"] for r in rows)
    ttft, tpot = percentiles(ttfts), percentiles(tpots)
    return {"cpu_s": clock, "wall_s": wall, "num_steps": len(steps), "output_tokens": out_tokens,
            "output_tok_per_cpu_s": out_tokens / clock, "output_tok_per_wall_s": out_tokens / wall,
            "ttft_cpu_p50_s": ttft.p50, "ttft_cpu_p99_s": ttft.p99, "ttft_cpu_max_s": max(ttfts),
            "tpot_cpu_p50_s": tpot.p50, "tpot_cpu_p99_s": tpot.p99,
            "requests": sorted(rows, key=lambda r: r["index"]),
            "steps": [{k: v for k, v in s.items() if k != "end_clock"} for s in steps]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=parse_range, default=(64, 512))
    p.add_argument("--output-len", type=parse_range, default=(16, 256))
    p.add_argument("--shared-prefix-len", type=int, default=0, help="words of a system prompt before every prompt")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--budgets", nargs="+", default=["adaptive"], help="adaptive, N or LO-HI")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tail", type=int, default=6, help="print this many requests of the largest TTFT")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    llms = {b: LLM(dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=args.max_num_seqs,
                   kv_cache_memory_bytes=1 << 30, max_model_len=4096,
                   enable_prefix_caching=args.shared_prefix_len > 0,
                   min_num_batched_tokens=parse_budget(b)[0], max_num_batched_tokens=parse_budget(b)[1])
            for b in args.budgets}
    def prompts(rnd: int) -> list[tuple[str, int]]:  # each round's own words after the shared prefix
        reqs = random_requests(args.num_prompts, args.input_len, args.output_len, args.shared_prefix_len, seed=0,
                               variant=rnd)
        return [(r.prompt, r.output_len) for r in reqs]

    warm = random_requests(args.concurrency, args.input_len, (2, 2), seed=1)  # without the shared prefix
    for llm in llms.values():  # kernels loaded, first-call allocations made
        run_closed_loop(llm, [(r.prompt, 2) for r in warm], args.concurrency)
    runs = {b: [] for b in args.budgets}
    for rnd in range(args.rounds):
        for b in (args.budgets if rnd % 2 == 0 else args.budgets[::-1]):
            r = run_closed_loop(llms[b], prompts(rnd), args.concurrency)
            r["load_avg_1"] = os.getloadavg()[0]
            runs[b].append(r)
            print(f"round {rnd} {b}: {r['num_steps']} steps, CPU {r['cpu_s']:.1f} s (wall {r['wall_s']:.1f}, load "
                  f"{r['load_avg_1']:.1f}): {r['output_tok_per_cpu_s']:.1f} output tok per CPU s; TTFT p50 / p99 / "
                  f"max {r['ttft_cpu_p50_s']:.2f} / {r['ttft_cpu_p99_s']:.2f} / {r['ttft_cpu_max_s']:.2f} CPU s; "
                  f"TPOT p50 / p99 {1e3 * r['tpot_cpu_p50_s']:.1f} / {1e3 * r['tpot_cpu_p99_s']:.1f} CPU ms",
                  flush=True)
            for q in sorted(r["requests"], key=lambda q: -q["ttft_cpu_s"])[:args.tail]:
                print(f"    {q['req_id']:>4s} prompt {q['prompt_len']:3d}: sent step {q['sent_step']:4d}, first "
                      f"token step {q['first_step']:4d}, TTFT {q['ttft_cpu_s']:.2f} CPU s, waited "
                      f"{q['waited_steps']} steps / {q['waited_tokens']} tokens")
    summary = {b: {k: statistics.median(r[k] for r in rs) for k in (
        "num_steps", "output_tok_per_cpu_s", "ttft_cpu_p50_s", "ttft_cpu_p99_s", "ttft_cpu_max_s", "tpot_cpu_p50_s",
        "tpot_cpu_p99_s")} for b, rs in runs.items()}
    for b, s in summary.items():
        print(f"{b}: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items()))
    if args.out:
        write_json(args.out, {"machine": machine_info(), "args": vars(args), "summary": summary, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
