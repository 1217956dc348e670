"""Speculative decoding (issue 12): TPOT with n-gram drafts, a draft model (the target GGUF itself, as a cheaper
self-draft) and speculation off, at several stream counts, rounds interleaved.

Workload: an analytics chat whose answers quote the prompt. A long system prompt holds a table (40 rows);
each question asks for some rows copied verbatim, so n-gram lookup can draft the answer from the prompt.
Greedy, fixed max_tokens, eos ignored so every setting emits the same number of tokens.

TPOT per request = (last token time - first token time) / (tokens - 1), from RequestOutput.metrics.
1 stream: requests one after another; N streams: N requests at once (max_num_seqs = the largest N, >= 16).

Every setting's engine is built first; then each round runs every stream count for every setting in turn
(off first), so a load change on a shared machine hits all settings alike. A setting's TPOT is the median of
its rounds' mean TPOTs; its ratio is off's median over its own.

Target and draft: every row runs the same target (--target-dtype / --target-quantization; the JSON records
what the engine resolved). Each draft_model row's draft is the same GGUF in its own format (--drafts
DTYPE/QUANTIZATION ...) drafting for a full-precision target (--target-quantization none, dense bf16 on an
AMX CPU), the case where a quantized self-draft can pay. By default two drafts: float32/none (on the embedded
GGUF the loader finds its exact Q4_1 blocks and decodes through them with float32 activations, the cheapest
single-token path today) and bfloat16/gguf (the GGUF blocks on the bf16/AMX kernel). The *_default rows (ngram and
the first draft) keep the method's default disable_by_batch_size; the others are always on.

    flock /work/wt/BENCH_LOCK -c "python benchmarks/speculative.py --out benchmarks/results/speculative.json"
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time

from common import machine_info, write_json

from pagedserve import LLM, SamplingParams
from pagedserve.spec_decode.draft_model import DraftModel

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


def build(spec: dict | None, args, max_num_seqs: int, convs, params) -> LLM:
    llm = LLM(max_num_seqs=max_num_seqs, kv_cache_memory_bytes=args.kv_cache_mib << 20, speculative_config=spec,
              num_threads=args.num_threads, dtype=args.target_dtype, quantization=args.target_quantization)
    llm.chat(convs[:1], params, use_tqdm=False)  # warm-up; also puts the system prompt in the prefix cache
    return llm


def configuration(llm: LLM) -> dict:
    # What the engine resolved (dtype "auto", quantization None), so the JSON says what each row ran.
    config = llm.llm_engine.core.config
    out = {"target": {"dtype": config.model.dtype, "quantization": config.model.quantization}}
    drafter = llm.llm_engine.core.executor.proposer
    if isinstance(drafter, DraftModel):
        out["draft"] = {"dtype": str(drafter.dtype).removeprefix("torch."), "quantization": drafter.quantization}
    return out


def run_once(llm: LLM, convs, num_streams: int, num_single: int, params) -> tuple[dict, list[str]]:
    s = llm.llm_engine.core.stats.spec
    before = (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
    t0 = time.perf_counter()
    if num_streams == 1:
        outs = [o for conv in convs[:num_single] for o in llm.chat([conv], params, use_tqdm=False)]
    else:
        outs = llm.chat(convs[:num_streams], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    drafts, draft_tokens, accepted = (s.num_drafts - before[0], s.num_draft_tokens - before[1],
                                      s.num_accepted_tokens - before[2])
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": num_tokens, "tpot_mean_ms": 1000 * statistics.mean(
        t for t in map(tpot, outs) if t is not None), "drafts": drafts, "draft_tokens": draft_tokens,
        "accepted": accepted}, [o.outputs[0].text for o in outs]


def summarize(rounds: list[dict]) -> dict:
    drafts, draft_tokens, accepted = (sum(r[k] for r in rounds) for k in ("drafts", "draft_tokens", "accepted"))
    return {"rounds": len(rounds), "output_tokens_per_round": rounds[0]["output_tokens"],
            "tpot_mean_ms_per_round": [round(r["tpot_mean_ms"], 2) for r in rounds],
            "tpot_ms": round(statistics.median(r["tpot_mean_ms"] for r in rounds), 2),
            "output_tok_per_s": round(statistics.median(r["output_tokens"] / r["wall_s"] for r in rounds), 2),
            "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/speculative.json")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per setting; medians reported")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--num-single", type=int, default=3, help="requests run one after another at 1 stream")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--kv-cache-mib", type=int, default=512)
    ap.add_argument("--target-dtype", default="auto", help="every row's target dtype (--dtype)")
    ap.add_argument("--target-quantization", default="none", choices=["none", "gguf", "int8"],
                    help="every row's target weights (--quantization): none = full precision (dense weights), "
                         "gguf = the GGUF's own blocks (the engine's default for a GGUF file)")
    ap.add_argument("--draft-model", default=None, help="draft_model row's draft (default: the embedded model)")
    ap.add_argument("--drafts", nargs="+", default=["float32/none", "bfloat16/gguf"], metavar="DTYPE/QUANTIZATION",
                    help="one draft_model row per draft format: gguf = the GGUF's Q4_1 blocks; int8 = the GGUF "
                         "requantized to Q8_0 blocks (float32 only); none = dense (float32 still reads the exact "
                         "Q4_1 blocks at decode, layers/linear.py)")
    ap.add_argument("--skip-draft", action="store_true", help="no draft_model rows")
    ap.add_argument("--skip-defaults", action="store_true",
                    help="no rows with the default disable_by_batch_size (they differ from the always-on rows only "
                         "above the cut-off)")
    ap.add_argument("--note", default=None, help="recorded in the JSON (e.g. other jobs on the machine)")
    args = ap.parse_args()
    machine = machine_info()
    max_streams = max(args.streams)
    convs = conversations(max(16, max_streams), seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    specs = {"off": None, "ngram": {**ngram, "disable_by_batch_size": None}}  # always on: its cost shows
    if not args.skip_draft:
        from pagedserve.model.loader import default_model_path

        for draft in args.drafts:
            dtype, quantization = draft.split("/")
            specs[f"draft_model_{dtype}_{quantization}"] = {
                "method": "draft_model", "model": args.draft_model or default_model_path(), "dtype": dtype,
                "quantization": quantization, "num_speculative_tokens": args.k, "disable_by_batch_size": None}
    if not args.skip_defaults and max_streams > 1:  # the method's default cut-off: it matters above 1 stream
        for name in ["ngram"] + [n for n in specs if n.startswith("draft_model")][:1]:
            specs[name + "_default"] = {k: v for k, v in specs[name].items() if k != "disable_by_batch_size"}
    llms = {name: build(spec, args, max(16, max_streams), convs, params) for name, spec in specs.items()}
    runs: dict[tuple[str, int], list[dict]] = {}
    texts: dict[str, list[str]] = {}
    for r in range(args.rounds):
        for n in args.streams:
            for name, llm in llms.items():
                if n == 1 and name.endswith("_default"):
                    continue
                result, out_texts = run_once(llm, convs, n, args.num_single, params)
                runs.setdefault((name, n), []).append(result)
                if n == 1 and r == 0:
                    texts[name] = out_texts
                print(f"round {r} {n:3d} streams {name:30s} TPOT {result['tpot_mean_ms']:8.2f} ms", flush=True)
    settings = {name: {"speculative_config": spec, **configuration(llms[name]),
                       **{f"{n}_streams": summarize(runs[name, n]) for n in args.streams if (name, n) in runs}}
                for name, spec in specs.items()}
    del llms
    gc.collect()
    summary = {}
    for n in args.streams:
        key = f"{n}_streams"
        off = settings["off"][key]["tpot_ms"]
        summary[key] = {name: {"tpot_ms": s[key]["tpot_ms"], "tpot_ratio_off_over_on": round(off / s[key]["tpot_ms"], 3),
                               "acceptance_rate": s[key]["acceptance_rate"],
                               "mean_acceptance_length": s[key]["mean_acceptance_length"]}
                        for name, s in settings.items() if key in s}
    identical = {name: t == texts["off"] for name, t in texts.items() if name != "off"}
    machine["load_avg_after"] = list(os.getloadavg())
    write_json(args.out, {"machine": machine, "args": vars(args), "note": args.note, "summary": summary,
                          "greedy_text_identical_1_stream": identical, "settings": settings,
                          "example_answer": texts["off"][0] if texts.get("off") else None})
    for key, rows in summary.items():
        for name, r in rows.items():
            print(f"{key:11s} {name:30s} TPOT {r['tpot_ms']:8.2f} ms  off/on {r['tpot_ratio_off_over_on']:.3f}  "
                  f"acceptance {r['acceptance_rate']}  mean length {r['mean_acceptance_length']}")
    print("greedy text identical at 1 stream:", identical, "load:", machine["load_avg_after"])


if __name__ == "__main__":
    main()
