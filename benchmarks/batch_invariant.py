"""The cost of --batch-invariant (docs/batch_invariance.md): offline throughput and TTFT, mode off vs on, A/B in turns.

    python benchmarks/batch_invariant.py --model /work/models/llama-3.2-1b-Q4_K_M.gguf --order 0,1,0,1

Each run is its own process, in the order given (0: default, 1: batch-invariant), on the same seeded prompts
(random token ids, greedy, ignore_eos, no prefix caching): TTFT of one prompt alone (median of --ttft-reps,
max_tokens=1), then --streams prompts at once for --output-len tokens (output tok/s over the whole generate call,
prefill included). Prints each run; --out writes them with the load averages and the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from common import child_run, machine_info, write_json


def run_one(args, invariant: bool) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, batch_invariant=invariant, enable_prefix_caching=False,
              max_num_seqs=args.streams, num_threads=args.threads,
              max_model_len=max(args.ttft_len, args.prompt_len) + args.output_len + 16)
    rng = random.Random(0)
    ids = lambda n: {"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(n)]}  # noqa: E731
    llm.generate([ids(16)], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    ttfts = []
    for _ in range(args.ttft_reps):
        prompt = ids(args.ttft_len)
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        ttfts.append(time.perf_counter() - start)
    prompts = [ids(args.prompt_len) for _ in range(args.streams)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"ttft_s": round(statistics.median(ttfts), 3), "tok_s": round(tokens / seconds, 2),
            "seconds": round(seconds, 2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ttft-len", type=int, default=256)
    p.add_argument("--ttft-reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--order", default="0,1,0,1", help="batch-invariant off (0) / on (1), run in this order")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(run_one(args, bool(args.child))))
        return
    runs = []
    for value in args.order.split(","):
        runs.append(dict(child_run(__file__, "--child", value), batch_invariant=value == "1",
                         load_avg=os.getloadavg()[0]))
        print(runs[-1], flush=True)
    if args.out:
        write_json(args.out, {"command": " ".join(sys.argv), "runs": runs, "machine": machine_info()})


if __name__ == "__main__":
    main()
