"""Offline time to first token of a burst, and the attention time in it split into prefill and decode calls.

    python benchmarks/prefill_ttft.py prefill          # 16 prompts x 400 random tokens, 1 output token each
    python benchmarks/prefill_ttft.py shared           # 16 x (a cached 1,000-token prefix + 20-60 new tokens)
    python benchmarks/prefill_ttft.py prefill --output-len 64    # also decode

The embedded model, `--dtype auto` (bf16 on AVX512-BF16 / AMX CPUs), every request added at once. "shared"
first runs the 1,000-token prefix once so that its blocks are in the prefix cache: each request then prefills
only its suffix, whose queries attend to the cached prefix's blocks. Attention time is the CPU backend's
forward (every layer's call), counted as prefill when the step has a sequence with more than one new token.
To compare two trees, run this file of one with PYTHONPATH pointing at the other's src/ (and its own
PAGEDSERVE_CACHE_DIR), alternating.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import allowed_token_ids  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.attention import cpu_paged  # noqa: E402


def time_attention(totals: dict, counts: collections.Counter) -> None:
    forward = cpu_paged.CpuPagedAttentionBackend.forward

    def timed(self, query, key, value, kv_cache, meta, scale):
        t0 = time.perf_counter()
        out = forward(self, query, key, value, kv_cache, meta, scale)
        kind = "prefill" if max(meta.query_lens_list) > 1 else "decode"
        totals[kind] += time.perf_counter() - t0
        counts[kind] += 1
        return out
    cpu_paged.CpuPagedAttentionBackend.forward = timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("case", choices=("prefill", "shared"))
    p.add_argument("--output-len", type=int, default=1)
    p.add_argument("--num-threads", type=int, default=1)
    args = p.parse_args()
    totals: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    time_attention(totals, counts)
    llm = LLM(dtype="auto", num_threads=args.num_threads)
    ids = allowed_token_ids(llm.get_tokenizer(), llm.llm_engine.hf_config.vocab_size)
    rng = random.Random(0)
    if args.case == "prefill":
        prompts = [[rng.choice(ids) for _ in range(400)] for _ in range(16)]
    else:
        system = [rng.choice(ids) for _ in range(1000)]
        llm.generate([{"prompt_token_ids": system + [ids[0]]}], SamplingParams(max_tokens=1), use_tqdm=False)
        prompts = [system + [rng.choice(ids) for _ in range(rng.randint(20, 60))] for _ in range(16)]
    llm.generate([{"prompt_token_ids": [ids[1]] * 8}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    totals.clear()
    counts.clear()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    print(json.dumps({"case": args.case, "output_len": args.output_len, "wall_s": round(wall, 3),
                      "ttft_p50_s": round(statistics.median(ttft), 3), "ttft_max_s": round(ttft[-1], 3),
                      "attn_prefill_s": round(totals["prefill"], 3), "prefill_calls": counts["prefill"],
                      "attn_decode_s": round(totals["decode"], 3), "decode_calls": counts["decode"],
                      "load_avg_1_5_15_end": list(os.getloadavg())}), flush=True)


if __name__ == "__main__":
    main()
