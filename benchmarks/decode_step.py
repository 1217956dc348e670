"""Wall time of one decode step at N concurrent sequences, and where it goes (torch.profiler op self time).

    python benchmarks/decode_step.py                                   # 16 sequences at 450 prompt tokens
    python benchmarks/decode_step.py --streams 16 --context 450 --rounds 3 --out benchmarks/results/x.json

The engine gets N prompts of --context random tokens (prefix caching off, so every round computes the same
work; with --shared-prefix, on, and the prompts start alike) and is stepped until every sequence has its first token; then each of the next --steps steps (all N
sequences decoding, the context growing by one token a step) is timed on its own. A round reports the median
step; the result is the median over rounds. One more round runs its decode steps under torch.profiler for the
op breakdown per step (which includes the profiler's own overhead).
To compare two checkouts, run this script with each one's sources first on PYTHONPATH and its own
PAGEDSERVE_CACHE_DIR (each builds its own kernels), alternating, on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import allowed_token_ids, machine_info, write_json  # noqa: E402

from pagedserve import LLM, SamplingParams, kernels  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--context", type=int, default=450, help="prompt tokens per sequence")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="the first N prompt tokens are the same for every sequence (prefix caching on, so their KV "
                        "blocks are shared)")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--no-ops", action="store_true", help="skip the profiled run")
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args()

    llm = LLM(num_threads=args.num_threads, max_num_seqs=args.streams, enable_prefix_caching=args.shared_prefix > 0,
              max_num_batched_tokens=args.max_num_batched_tokens)
    ids = allowed_token_ids(llm.get_tokenizer(), llm.llm_engine.hf_config.vocab_size)
    rng = random.Random(0)  # the same prompts for every checkout compared
    shared = [rng.choice(ids) for _ in range(args.shared_prefix)]
    prompts = [{"prompt_token_ids": shared + [rng.choice(ids) for _ in range(args.context - len(shared))]}
               for _ in range(args.streams)]

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 2, ignore_eos=True)

    def decode_steps(profile: bool = False) -> tuple[list[float], dict[str, float]]:
        # ms of each decode step once every sequence has its first token; op ms per step when profiled
        ids = [engine.next_request_id() for _ in prompts]
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        started: set[str] = set()
        while len(started) < len(ids):
            started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
        if prof is not None:
            prof.__enter__()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t0) * 1e3)
        ops = {}
        if prof is not None:
            prof.__exit__(None, None, None)
            ops = {e.key: e.self_cpu_time_total / 1e3 / args.steps for e in prof.key_averages()}
        while engine.has_unfinished_requests():
            engine.step()
        return times, ops

    decode_steps()  # warm-up
    steps_ms = []
    for _ in range(args.rounds):
        steps_ms.append(statistics.median(decode_steps()[0]))
        print(f"decode step {steps_ms[-1]:.1f} ms (median of {args.steps})", flush=True)
    result = {"command": " ".join(sys.argv), "machine": machine_info(), "kernels": kernels.selected_isa(),
              "streams": args.streams, "context": args.context, "shared_prefix": args.shared_prefix, "steps": args.steps,
              "decode_step_ms": steps_ms, "decode_step_ms_median": statistics.median(steps_ms)}
    print(f"median decode step: {result['decode_step_ms_median']:.1f} ms at {args.streams} sequences")
    if not args.no_ops:
        times, per_step = decode_steps(profile=True)
        result["profiled_step_ms_median"] = statistics.median(times)
        top = dict(sorted(per_step.items(), key=lambda kv: -kv[1])[:10])
        result["op_ms_per_step"] = {k: round(v, 3) for k, v in top.items()}
        result["op_ms_per_step_total"] = round(sum(per_step.values()), 2)
        print(f"op self time per decode step (profiled): {result['op_ms_per_step_total']:.1f} ms of "
              f"{result['profiled_step_ms_median']:.1f} ms (median step of that round)")
        for k, v in top.items():
            print(f"  {k:45s} {v:7.2f} ms")
    result["load_avg_after"] = os.getloadavg()
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
