"""Where an offline run's time goes: per-phase wall time of the engine step, plus torch.profiler op groups.

    python benchmarks/profile_step.py --num-prompts 64            # phase breakdown + tokens/s
    python benchmarks/profile_step.py --num-prompts 16 --ops      # also torch op groups (slower; ~6 GB RAM)
    python benchmarks/profile_step.py --single 128                # single-stream decode ms/token only
    PAGEDSERVE_KERNELS=0 python benchmarks/profile_step.py --attention-backend reference ...
                                                                  # every CPU fast path off: the baseline

Phases wrap the engine's own methods (instance attributes shadow them), so the engine runs unchanged:
schedule, build inputs (metadata), model forward (split into linears / attention / other by the profiler),
LM head, sampling, scheduler update, engine bookkeeping + detokenization (the rest of step()).
The workload is the throughput benchmark's: random token prompts, ignore_eos outputs, one seed.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import allowed_token_ids, synthetic_requests  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402


class PhaseTimer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = collections.defaultdict(float)

    def wrap(self, obj, attr: str, phase: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - t0
        setattr(obj, attr, timed)


def instrument(llm: LLM) -> PhaseTimer:
    eng = llm.llm_engine
    timer = PhaseTimer()
    runner = eng.runner
    timer.wrap(eng, "step", "step_total")
    timer.wrap(eng.scheduler, "schedule", "schedule")
    timer.wrap(eng.scheduler, "update", "scheduler_update")
    timer.wrap(runner, "update_states", "update_states")
    timer.wrap(runner, "execute_model", "execute_total")
    timer.wrap(runner, "build_metadata", "build_inputs")
    timer.wrap(runner.model, "forward", "model_forward")  # nn.Module __call__ finds the instance attribute
    timer.wrap(runner.model, "compute_logits", "lm_head")
    timer.wrap(runner, "sampler", "sampling")
    return timer


def single_stream(llm: LLM, num_tokens: int, prompt_len: int = 64) -> tuple[float, float]:
    # (best, median) ms per token of 3 generations; serving.py reports medians, so compare those.
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(1000, 1000 + prompt_len))}
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    per_token = []
    for _ in range(3):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        m = out.metrics
        # Decode time only: from the first token to the last.
        per_token.append((m.last_token_time - m.first_token_time) / (num_tokens - 1) * 1e3)
    return min(per_token), statistics.median(per_token)


def op_group(name: str) -> str:
    if name in ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm",
                "mkldnn::_linear_pointwise"):
        return "matmul"
    if ("scaled_dot_product" in name or "flash_attention" in name or name in ("aten::index", "aten::index_copy_")
            or name == "pagedserve::paged_attention"):
        return "attention"
    if name in ("aten::argmax", "aten::topk", "aten::sort", "aten::softmax", "aten::exponential_"):
        return "sampling ops"
    return "other: " + name


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, nargs=2, default=(64, 512))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ops", action="store_true", help="run under torch.profiler and print op groups")
    p.add_argument("--single", type=int, default=0, help="only measure single-stream decode of N tokens")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--dtype", default=None, help="engine --dtype (default: the engine's, auto)")
    p.add_argument("--quantization", default=None, help="engine --quantization (default: the engine's)")
    p.add_argument("--kv-cache-dtype", default=None, help="engine --kv-cache-dtype (default: auto)")
    args = p.parse_args()

    kwargs = {"num_threads": args.num_threads, "attention_backend": args.attention_backend}
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    for name in ("dtype", "quantization", "kv_cache_dtype"):  # only when given: older engines lack them
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    llm = LLM(**kwargs)
    if args.single:
        best, median = single_stream(llm, args.single)
        print(f"single-stream decode: {best:.2f} ms/token (best of 3; median {median:.2f}) "
              f"(threads={torch.get_num_threads()})")
        return

    tok = llm.get_tokenizer()
    reqs = synthetic_requests(args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                              allowed_token_ids(tok, llm.llm_engine.hf_config.vocab_size), args.seed)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    timer = instrument(llm)
    prof = None
    if args.ops:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    if prof is not None:
        prof.__exit__(None, None, None)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(r.num_prompt_tokens for r in reqs)
    print(f"{args.num_prompts} requests, {n_in} prompt + {n_out} output tokens in {wall:.2f}s: "
          f"{n_out / wall:.1f} output tok/s, {(n_in + n_out) / wall:.1f} total tok/s "
          f"(threads={torch.get_num_threads()}, steps={llm.llm_engine.stats.num_steps})")
    t = timer.totals
    rows = {
        "schedule": t["schedule"],
        "build inputs": t["build_inputs"],
        "model forward": t["model_forward"],
        "LM head": t["lm_head"],
        "sampling": t["sampling"],
        "runner other": t["execute_total"] - t["build_inputs"] - t["model_forward"] - t["lm_head"] - t["sampling"],
        "scheduler update": t["scheduler_update"],
        "runner state update": t["update_states"],
        "engine/detok": t["step_total"] - t["schedule"] - t["update_states"] - t["execute_total"]
        - t["scheduler_update"],
        "outside step": wall - t["step_total"],
    }
    for k, v in rows.items():
        print(f"  {k:18s} {v:8.2f}s {100 * v / wall:5.1f}%")
    if prof is not None:
        groups: dict[str, float] = collections.defaultdict(float)
        for e in prof.key_averages():
            groups[op_group(e.key)] += e.self_cpu_time_total / 1e6
        total = sum(groups.values())
        print(f"  torch ops self time {total:.2f}s; top groups:")
        for k, v in sorted(groups.items(), key=lambda kv: -kv[1])[:20]:
            print(f"    {k:40s} {v:8.2f}s {100 * v / total:5.1f}%")


if __name__ == "__main__":
    main()
