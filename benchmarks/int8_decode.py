"""Batched offline decode of a GGUF with and without the int8 block GEMM (PAGEDSERVE_GGUF_INT8), A/B in turns.

    python benchmarks/int8_decode.py --model /work/models/llama-3.2-1b-Q4_K_M.gguf --streams 16 --output-len 32
    python benchmarks/int8_decode.py --model /work/models/llama-3.2-1b-Q4_K_M.gguf --dtype auto --prompt-len 512 \
        --order 1,0,1,0                      # prefill-bound: 512-token prompts, bf16 activations

Each setting runs in its own process (the dispatcher reads the variable once per weight type), in the order
given by --order, on the same seeded prompts (random token ids, greedy, ignore_eos): output tok/s over the
whole generate call (prefill included: with int8 from 5 rows of x on, without through dequantized tiles above
64 rows), decode tok/s (the same call less a prefill-only one: tokens after each stream's first), TTFT of one
prompt alone (prefill and first token, median of 3), and the first tokens of the first stream (on a
random-weight model the logits are nearly flat, so greedy picks may differ once int8 moves them by x's
rounding). Each run records the load average after it (the machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from common import int8_child_run, machine_info, write_json


def run_one(model: str, streams: int, prompt_len: int, output_len: int, threads: int, dtype: str) -> dict:
    import torch

    from pagedserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    # no prefix caching: the timed call recomputes the prompts the prefill-only call ran
    llm = LLM(model=model, max_model_len=prompt_len + output_len + 16, dtype=dtype, enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(prompt_len)]} for _ in range(streams)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    ttft = []
    for prompt in prompts[1:4]:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        ttft.append(time.perf_counter() - start)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    prefill = time.perf_counter() - start  # and the first token
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": round(tokens / seconds, 2), "decode_tok_s": round((tokens - streams) / (seconds - prefill), 2),
            "seconds": round(seconds, 2), "prefill_s": round(prefill, 2),
            "ttft_s": round(sorted(ttft)[len(ttft) // 2], 3),
            "first_ids": list(outs[0].outputs[0].token_ids[:8])}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", help="activations: float32, bfloat16 or auto")
    p.add_argument("--order", default="1,0", help="PAGEDSERVE_GGUF_INT8 values, run in this order")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_one(args.model, args.streams, args.prompt_len, args.output_len, args.threads,
                                     args.dtype)))
        return
    result = {"command": " ".join(sys.argv), "load_avg_before": os.getloadavg(), "runs": []}
    for value in args.order.split(","):
        run = dict(int8_child_run(__file__, value), load_avg_after=os.getloadavg()[0])
        result["runs"].append(run)
        print(run, flush=True)
    if args.out:
        write_json(args.out, dict(result, load_avg_after=os.getloadavg(), machine=machine_info()))


if __name__ == "__main__":
    main()
