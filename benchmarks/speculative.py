"""Speculative decoding (issue 12): TPOT with n-gram drafts, a draft model (the target GGUF itself, requantized
to Q8_0 blocks: a quantized self-draft) and speculation off, at 1 and 16 streams, one run.

Workload: an analytics chat whose answers quote the prompt. A long system prompt holds a table (40 rows);
each question asks for some rows copied verbatim, so n-gram lookup can draft the answer from the prompt.
Greedy, fixed max_tokens, eos ignored so every setting emits the same number of tokens.

TPOT per request = (last token time - first token time) / (tokens - 1), from RequestOutput.metrics.
1 stream: requests one after another; 16 streams: 16 requests at once (max_num_seqs=16).

    flock /work/wt/BENCH_LOCK -c "python benchmarks/speculative.py --out benchmarks/results/speculative.json"
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from common import machine_info, write_json

from pagedserve import LLM, SamplingParams

CITIES = ["Berlin", "Madrid", "Rome", "Paris", "Vienna", "Prague", "Warsaw", "Lisbon", "Dublin", "Oslo",
          "Athens", "Helsinki", "Budapest", "Brussels", "Zurich", "Munich", "Milan", "Lyon", "Porto", "Krakow"]


def system_prompt(rng: random.Random) -> tuple[str, list[str]]:
    rows, keys = [], []
    for i in range(40):
        key = f"ORD-{1000 + i * 7}"
        keys.append(key)
        rows.append(f"| {key} | {rng.choice(CITIES)} | {rng.randint(1, 40)} units | {rng.randint(10, 999)}.{rng.randint(0, 99):02d} EUR | "
                    f"{rng.choice(['shipped', 'pending', 'returned', 'cancelled'])} |")
    table = "\n".join(["| order | city | quantity | amount | status |", "|---|---|---|---|---|"] + rows)
    text = ("You are the analytics assistant of an order dashboard. Answer only from this table, and when asked "
            "for rows, copy them exactly as they appear, one per line.\n\n" + table)
    return text, keys


def conversations(num: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    system, keys = system_prompt(rng)
    convs = []
    for _ in range(num):
        wanted = rng.sample(keys, 3)
        convs.append([{"role": "system", "content": system},
                      {"role": "user", "content": f"Copy the rows for orders {', '.join(wanted)}."}])
    return convs


def tpot(out) -> float | None:
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    if m is None or m.first_token_time is None or n < 2:
        return None
    return (m.last_token_time - m.first_token_time) / (n - 1)


def run_setting(name: str, spec: dict | None, convs, streams: list[int], max_tokens: int, threads: int | None,
                num_single: int):
    llm = LLM(max_num_seqs=16, kv_cache_memory_bytes=256 << 20, speculative_config=spec, num_threads=threads)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat(convs[:1], params, use_tqdm=False)  # warm-up; also puts the system prompt in the prefix cache
    core = llm.llm_engine.core
    result = {"speculative_config": spec}
    texts = None
    for num_streams in streams:
        before = (core.stats.spec.num_drafts, core.stats.spec.num_draft_tokens, core.stats.spec.num_accepted_tokens)
        t0 = time.perf_counter()
        outs = []
        batch = convs[:num_single] if num_streams == 1 else convs[:num_streams]
        if num_streams == 1:
            for conv in batch:
                outs += llm.chat([conv], params, use_tqdm=False)
        else:
            outs = llm.chat(batch, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        s = core.stats.spec
        drafts, draft_tokens, accepted = (s.num_drafts - before[0], s.num_draft_tokens - before[1],
                                          s.num_accepted_tokens - before[2])
        tpots = [t for t in map(tpot, outs) if t is not None]
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result[f"{num_streams}_streams"] = {
            "num_requests": len(outs), "output_tokens": num_tokens, "wall_s": round(wall, 3),
            "output_tok_per_s": round(num_tokens / wall, 2),
            "tpot_mean_ms": round(1000 * statistics.mean(tpots), 2),
            "tpot_median_ms": round(1000 * statistics.median(tpots), 2),
            "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        }
        if num_streams == 1:
            texts = [o.outputs[0].text for o in outs]
        print(name, num_streams, result[f"{num_streams}_streams"], flush=True)
    del llm, core
    gc.collect()
    return result, texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/speculative.json")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--num-single", type=int, default=3, help="requests run one after another at 1 stream")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--draft-model", default=None, help="draft_model row's draft (default: the embedded model)")
    ap.add_argument("--draft-dtype", default="float32", help="the draft's dtype")
    ap.add_argument("--draft-quantization", default="int8",
                    help="the draft's weights: int8 = the GGUF requantized to Q8_0 blocks (a cheaper self-draft "
                         "where Q8_0 runs faster than Q4_1); gguf = the target's own blocks")
    ap.add_argument("--skip-draft", action="store_true", help="no draft_model row")
    ap.add_argument("--note", default=None, help="recorded in the JSON (e.g. other jobs on the machine)")
    args = ap.parse_args()
    machine = machine_info()
    convs = conversations(max(16, max(args.streams)), seed=0)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    # The default cut-off (disable_by_batch_size) changes nothing at 1 stream, so it runs at >1 streams only.
    settings = {"off": (None, args.streams),
                "ngram": ({**ngram, "disable_by_batch_size": None}, args.streams),  # always on: its cost
                "ngram_default": (ngram, [n for n in args.streams if n > 1])}       # with the default cut-off
    if not args.skip_draft:
        from pagedserve.model.loader import default_model_path

        # A self-draft: the target's weights in a cheaper format, always on (its cost at 16 streams shows).
        draft = {"method": "draft_model", "model": args.draft_model or default_model_path(),
                 "dtype": args.draft_dtype, "quantization": args.draft_quantization,
                 "num_speculative_tokens": args.k, "disable_by_batch_size": None}
        settings["draft_model"] = (draft, args.streams)
    results, texts = {}, {}
    for name, (spec, streams) in settings.items():
        if streams:
            results[name], texts[name] = run_setting(name, spec, convs, streams, args.max_tokens,
                                                     args.num_threads, args.num_single)
    summary = {}
    for n in args.streams:
        key = f"{n}_streams"
        off = results["off"][key]["tpot_mean_ms"]
        summary[key] = {name: {"tpot_mean_ms": r[key]["tpot_mean_ms"],
                               "tpot_ratio_off_over_on": round(off / r[key]["tpot_mean_ms"], 3),
                               "acceptance_rate": r[key]["acceptance_rate"],
                               "mean_acceptance_length": r[key]["mean_acceptance_length"]}
                        for name, r in results.items() if key in r}
    same = texts["off"] == texts["ngram"]
    same_draft = texts["off"] == texts["draft_model"] if "draft_model" in texts else None
    machine["load_avg_after"] = list(__import__("os").getloadavg())
    write_json(args.out, {"machine": machine, "args": vars(args), "note": args.note, "summary": summary,
                          "greedy_text_identical_1_stream": same,
                          "greedy_text_identical_1_stream_draft_model": same_draft, "settings": results,
                          "example_answer": texts["off"][0] if texts["off"] else None})
    for key, rows in summary.items():
        for name, r in rows.items():
            print(f"{key:11s} {name:14s} TPOT {r['tpot_mean_ms']:8.1f} ms  off/on {r['tpot_ratio_off_over_on']:.3f}  "
                  f"acceptance {r['acceptance_rate']}  mean length {r['mean_acceptance_length']}")
    print("greedy text identical:", same, "draft_model:", same_draft, "load:", machine["load_avg_after"])


if __name__ == "__main__":
    main()
