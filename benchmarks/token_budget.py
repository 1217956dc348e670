"""Offline prefill of a burst under different per-step token budgets (`max_num_batched_tokens`).

    python benchmarks/token_budget.py                                   # budgets 512 1024 2048 4096
    python benchmarks/token_budget.py --budgets 512 2048 --out benchmarks/results/token_budget_amx.json

The embedded model under `--dtype auto`, 2 threads, 16 prompts of 64-512 random tokens (the serving benchmark's
prompt lengths) added at once, one output token each: the time is the burst's prefill, which is what the last
request's time to first token waits for under FCFS. One engine per budget, built up front; rounds interleave the
budgets and the medians are reported. Prefix caching is off so every round prefills every token.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import allowed_token_ids, machine_info, synthetic_requests, write_json  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    llms = {b: LLM(dtype="auto", num_threads=args.num_threads, max_num_batched_tokens=b,
                   kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
            for b in args.budgets}
    first = llms[args.budgets[0]]
    ids = allowed_token_ids(first.get_tokenizer(), first.llm_engine.hf_config.vocab_size)
    reqs = synthetic_requests(args.num_prompts, (64, 512), (1, 1), ids, seed=0)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    tokens = sum(r.num_prompt_tokens for r in reqs)
    params = SamplingParams(max_tokens=1, temperature=0)
    for llm in llms.values():  # warm up: kernels loaded, first-call allocations done
        llm.generate(prompts[:2], params, use_tqdm=False)
    times: dict[int, list[float]] = {b: [] for b in args.budgets}
    for _ in range(args.rounds):
        for b, llm in llms.items():
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[b].append(time.perf_counter() - start)
    rows = []
    for b in args.budgets:
        median = statistics.median(times[b])
        rows.append({"budget": b, "seconds": times[b], "median_s": median, "prompt_tok_per_s": tokens / median})
        print(f"budget {b:5d}: {median:.2f} s for {tokens} prompt tokens = {tokens / median:,.0f} tok/s "
              f"(rounds {', '.join(f'{t:.2f}' for t in times[b])})")
    if args.out:
        write_json(args.out, {"machine": machine_info(), "num_prompts": args.num_prompts, "prompt_tokens": tokens,
                              "num_threads": args.num_threads, "dtype": "auto",
                              "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
