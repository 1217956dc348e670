"""What sharing saves, measured in one run.

1. Parallel sampling (n=4) and beam search (width 4): KV blocks in use with sharing, against the blocks the
   same sequences would hold if each owned its blocks privately (sum of their block-table lengths), sampled
   at every scheduler step. The paper reports 6-30% savings for parallel sampling and 37-66% for beam search.
2. 32 requests sharing a 1,000-token system prompt: time to first token and throughput with automatic prefix
   caching on against off.

    python benchmarks/sharing.py --out benchmarks/results/sharing.json
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

from common import allowed_token_ids, engine_config_dict, machine_info, synthetic_requests, write_json

from pagedserve import LLM, BeamSearchParams, SamplingParams


class BlockMeter:
    """Wraps the scheduler's schedule() to sample block use right after each step's allocation."""

    def __init__(self, engine) -> None:
        self.kv = engine.kv
        self.shared: list[int] = []
        self.private: list[int] = []
        sched = engine.scheduler
        inner = sched.schedule

        def schedule():
            plan = inner()
            if not plan.is_empty:
                self.shared.append(self.kv.num_blocks - self.kv.pool.num_free_blocks)
                self.private.append(sum(len(b) for b in self.kv.req_blocks.values()))
            return plan

        sched.schedule = schedule

    def summary(self) -> dict:
        total_shared, total_private = sum(self.shared), sum(self.private)
        peak = max(range(len(self.private)), key=self.private.__getitem__)
        return {"steps": len(self.shared),
                "block_steps_with_sharing": total_shared, "block_steps_without_sharing": total_private,
                "saving_time_avg": 1 - total_shared / total_private,
                "peak_blocks_with_sharing": max(self.shared), "peak_blocks_without_sharing": max(self.private),
                "saving_at_peak": 1 - self.shared[peak] / self.private[peak]}


def parallel_sampling(args, tokens) -> dict:
    llm = LLM(kv_cache_memory_bytes=args.kv_bytes, max_num_seqs=64)
    meter = BlockMeter(llm.llm_engine)
    reqs = synthetic_requests(args.num_prompts, (args.input_min, args.input_max), (args.output_min, args.output_max),
                              tokens, args.seed)
    params = [SamplingParams(n=4, temperature=1.0, top_p=0.95, seed=i, max_tokens=r.max_tokens, ignore_eos=True)
              for i, r in enumerate(reqs)]
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params, use_tqdm=False)
    stats = llm.llm_engine.scheduler.stats()
    return {**meter.summary(), "num_prompts": len(reqs), "n": 4, "copy_on_write_copies": stats.num_cow_copies_total}


def beam_search(args, tokens) -> dict:
    llm = LLM(kv_cache_memory_bytes=args.kv_bytes, max_num_seqs=64)
    meter = BlockMeter(llm.llm_engine)
    reqs = synthetic_requests(args.num_beam_prompts, (args.input_min, args.input_max), (1, 1), tokens, args.seed)
    llm.beam_search([{"prompt_token_ids": r.prompt_token_ids} for r in reqs],
                    BeamSearchParams(beam_width=4, max_tokens=args.beam_tokens, ignore_eos=True))
    return {**meter.summary(), "num_prompts": len(reqs), "beam_width": 4, "max_tokens": args.beam_tokens}


def prefix_caching(args, tokens, enable: bool) -> dict:
    llm = LLM(kv_cache_memory_bytes=args.kv_bytes, max_num_seqs=64, enable_prefix_caching=enable)
    system = synthetic_requests(1, (args.system_len, args.system_len), (1, 1), tokens, args.seed)[0]
    questions = synthetic_requests(args.num_chat, (20, 60), (args.chat_output, args.chat_output), tokens,
                                   args.seed + 1)
    prompts = [{"prompt_token_ids": system.prompt_token_ids + q.prompt_token_ids} for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=args.chat_output, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    ttfts = sorted(o.metrics.ttft for o in outs)
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.llm_engine.scheduler.stats()
    result = {"enable_prefix_caching": enable, "wall_s": wall, "output_tokens_per_s": num_out / wall,
              "requests_per_s": len(outs) / wall, "ttft_mean_s": statistics.mean(ttfts),
              "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_p90_s": ttfts[int(len(ttfts) * 0.9)],
              "prefix_cache_hit_tokens": stats.prefix_cache_hits, "prefix_cache_query_tokens": stats.prefix_cache_queries,
              "engine_config": engine_config_dict(llm.llm_engine)}
    del llm
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-min", type=int, default=64)
    ap.add_argument("--input-max", type=int, default=512)
    ap.add_argument("--output-min", type=int, default=16)
    ap.add_argument("--output-max", type=int, default=128)
    ap.add_argument("--num-beam-prompts", type=int, default=4)
    ap.add_argument("--beam-tokens", type=int, default=32)
    ap.add_argument("--num-chat", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--chat-output", type=int, default=32)
    ap.add_argument("--kv-bytes", type=int, default=1 << 30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    probe = LLM(kv_cache_memory_bytes=16 << 20)
    tokens = allowed_token_ids(probe.get_tokenizer(), probe.llm_engine.hf_config.vocab_size)
    del probe
    result = {"machine": machine_info(), "args": vars(args)}
    result["parallel_sampling"] = ps = parallel_sampling(args, tokens)
    print(f"parallel sampling n=4: KV blocks saved {ps['saving_time_avg']:.1%} (time-average), "
          f"{ps['saving_at_peak']:.1%} at peak ({ps['peak_blocks_with_sharing']} vs {ps['peak_blocks_without_sharing']})")
    result["beam_search"] = bs = beam_search(args, tokens)
    print(f"beam search width 4: KV blocks saved {bs['saving_time_avg']:.1%} (time-average), "
          f"{bs['saving_at_peak']:.1%} at peak ({bs['peak_blocks_with_sharing']} vs {bs['peak_blocks_without_sharing']})")
    on = prefix_caching(args, tokens, True)
    off = prefix_caching(args, tokens, False)
    result["prefix_caching"] = {"on": on, "off": off,
                                "ttft_mean_ratio_off_over_on": off["ttft_mean_s"] / on["ttft_mean_s"],
                                "throughput_ratio_on_over_off": on["output_tokens_per_s"] / off["output_tokens_per_s"]}
    print(f"{args.num_chat} requests sharing a {args.system_len}-token system prompt: "
          f"TTFT mean {on['ttft_mean_s']:.2f}s with prefix caching vs {off['ttft_mean_s']:.2f}s without "
          f"({result['prefix_caching']['ttft_mean_ratio_off_over_on']:.1f}x); throughput "
          f"{on['output_tokens_per_s']:.1f} vs {off['output_tokens_per_s']:.1f} output tok/s "
          f"({result['prefix_caching']['throughput_ratio_on_over_off']:.1f}x)")
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
