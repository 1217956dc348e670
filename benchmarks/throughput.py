"""Offline throughput: pagedserve (continuous batching, paged KV) vs transformers static batching.

One seeded synthetic workload (random token ids, exact prompt lengths, output lengths forced with
ignore_eos) goes through both systems in the same process, so the ratio is measured under the same machine
load. It also reports KV memory waste (allocated-but-unused slots / allocated slots), sampled at every
pagedserve step right after the scheduler has allocated for it, for:

    paged               blocks held by running requests x block_size
    contiguous_max_len  each running request reserves max_model_len slots (output length unknown)
    contiguous_exact    each running request reserves prompt + max_tokens slots (best contiguous case)

The contiguous numbers replay pagedserve's own schedule (same running requests at the same moments); a
real contiguous server would fit fewer requests in the same memory. "Used" is the same for all three: the
tokens whose K/V is in the cache once the step has run (num_computed_tokens + tokens scheduled this step).

    python benchmarks/throughput.py --out benchmarks/results/throughput.json
"""
from __future__ import annotations

import argparse
import gc
import os
import time

import torch

from common import (allowed_token_ids, describe_workload, engine_config_dict, machine_info,
                    synthetic_requests, write_json)
from pagedserve import LLM, SamplingParams


class KVWasteSampler:
    # Wraps the engine's scheduler.schedule (an instance attribute shadows the method) so every plan is
    # sampled at the moment its blocks are allocated; the engine itself runs unchanged.
    SYSTEMS = ("paged", "contiguous_max_len", "contiguous_exact")

    def __init__(self, engine, max_model_len: int) -> None:
        self.engine = engine
        self.max_model_len = max_model_len
        self.samples: list[tuple[float, dict[str, int], int]] = []  # (time, allocated per system, used)
        self.peak_running = 0
        self._schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self._sampled_schedule

    def _sampled_schedule(self):
        plan = self._schedule()
        scheduled = plan.num_scheduled_tokens
        kv, alloc, used = self.engine.kv, dict.fromkeys(self.SYSTEMS, 0), 0
        for req in self.engine.scheduler.running:
            alloc["paged"] += len(kv.req_blocks.get(req.req_id, ())) * kv.block_size
            alloc["contiguous_max_len"] += self.max_model_len
            alloc["contiguous_exact"] += req.num_prompt_tokens + req.max_tokens
            used += req.num_computed_tokens + scheduled.get(req.req_id, 0)
        self.peak_running = max(self.peak_running, len(self.engine.scheduler.running))
        if alloc["paged"]:
            self.samples.append((time.perf_counter(), alloc, used))
        return plan

    def summary(self, end_time: float) -> dict:
        # Each sample holds until the next plan (the last one until end_time). time_avg is wasted slot-seconds
        # over allocated slot-seconds; peak is the waste at the sample where that system allocates the most.
        times = [s[0] for s in self.samples] + [end_time]
        out = {"num_samples": len(self.samples)}
        for name in self.SYSTEMS:
            wasted = allocated = 0.0
            step_wastes = []
            peak_alloc, peak_waste = 0, 0.0
            for i, (_, alloc, used) in enumerate(self.samples):
                dt = times[i + 1] - times[i]
                a = alloc[name]
                wasted += (a - used) * dt
                allocated += a * dt
                step_wastes.append(1 - used / a)
                if a > peak_alloc:
                    peak_alloc, peak_waste = a, 1 - used / a
            out[name] = {"time_avg_waste": wasted / allocated,
                         "step_avg_waste": sum(step_wastes) / len(step_wastes),
                         "peak_time_waste": peak_waste, "peak_allocated_slots": peak_alloc}
        return out


def run_pagedserve(llm: LLM, reqs, max_model_len: int) -> dict:
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": reqs[0].prompt_token_ids[:16]}],
                 SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up, not timed
    steps0 = engine.stats.num_steps
    preempt0 = engine.scheduler.num_preemptions_total
    sampler = KVWasteSampler(engine, max_model_len)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_out == sum(r.max_tokens for r in reqs), "ignore_eos should force every requested token"
    return {"wall_s": wall, "cpu_s": cpu, "output_tokens": num_out,
            "output_tokens_per_s": num_out / wall, "output_tokens_per_cpu_s": num_out / cpu,
            "total_tokens_per_s": (num_out + sum(r.num_prompt_tokens for r in reqs)) / wall,
            "num_steps": engine.stats.num_steps - steps0,
            "num_preemptions": engine.scheduler.num_preemptions_total - preempt0,
            "peak_running": sampler.peak_running,
            "kv_waste": sampler.summary(t0 + wall)}


def run_transformers(reqs, batch_size: int, pad_id: int) -> dict:
    from transformers import AutoModelForCausalLM

    from pagedserve.model.loader import default_model_path

    path = default_model_path()
    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t_load

    def generate(batch):
        # Static batching: left-pad to the longest prompt; every row runs for the batch's longest output.
        width = max(r.num_prompt_tokens for r in batch)
        ids = torch.tensor([[pad_id] * (width - r.num_prompt_tokens) + r.prompt_token_ids for r in batch])
        mask = torch.tensor([[0] * (width - r.num_prompt_tokens) + [1] * r.num_prompt_tokens for r in batch])
        n = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad_id)
        return width, out.shape[1] - width

    generate([type(reqs[0])(reqs[0].prompt_token_ids[:16], 4)])  # warm-up, not timed
    generated = padding = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]  # arrival order, as a static server would batch them
        width, n_new = generate(batch)
        generated += len(batch) * n_new
        padding += sum(width - r.num_prompt_tokens for r in batch)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    # Only each request's own max_tokens count: a static server would cut the rest off.
    useful = sum(r.max_tokens for r in reqs)
    return {"wall_s": wall, "cpu_s": cpu, "load_s": load_s, "batch_size": batch_size, "output_tokens": useful,
            "generated_tokens_incl_discarded": generated, "prompt_padding_tokens": padding,
            "output_tokens_per_s": useful / wall, "output_tokens_per_cpu_s": useful / cpu,
            "total_tokens_per_s": (useful + sum(r.num_prompt_tokens for r in reqs)) / wall}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-min", type=int, default=64)
    p.add_argument("--input-len-max", type=int, default=512)
    p.add_argument("--output-len-min", type=int, default=16)
    p.add_argument("--output-len-max", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="engine max_model_len and the contiguous per-request reservation")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads for both (default: torch's)")
    p.add_argument("--dtype", default="auto", help="pagedserve --dtype (auto: bf16 on AMX/AVX512-BF16 CPUs)")
    p.add_argument("--also-dtype", default=None, metavar="DTYPE",
                   help="run pagedserve again with this --dtype (e.g. float32) and report the ratio")
    p.add_argument("--quantization", default=None, help="pagedserve --quantization (default: the engine's)")
    p.add_argument("--also-quantization", default=None, metavar="Q",
                   help="run pagedserve again with this --quantization (and --also-dtype, else --dtype)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="pagedserve --kv-cache-dtype of the first run (the --also run keeps auto: its dtype's)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    machine = machine_info()
    def make_llm(dtype: str, quantization: str | None, kv_cache_dtype: str = "auto") -> LLM:
        return LLM(max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   num_threads=args.num_threads, dtype=dtype, quantization=quantization,
                   kv_cache_dtype=kv_cache_dtype)

    llm = make_llm(args.dtype, args.quantization, args.kv_cache_dtype)
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    reqs = synthetic_requests(args.num_prompts, (args.input_len_min, args.input_len_max),
                              (args.output_len_min, args.output_len_max),
                              allowed_token_ids(tok, engine.hf_config.vocab_size), args.seed)
    workload = describe_workload(reqs, input_len=[args.input_len_min, args.input_len_max],
                                 output_len=[args.output_len_min, args.output_len_max], seed=args.seed,
                                 prompts="uniform random token ids excluding special tokens",
                                 sampling="greedy, ignore_eos, per-request max_tokens")
    print(f"workload: {workload['num_prompts']} requests, {workload['total_prompt_tokens']} prompt tokens, "
          f"{workload['total_output_tokens']} output tokens", flush=True)

    results: dict = {"workload": workload, "engine_config": engine_config_dict(engine)}
    paged = run_pagedserve(llm, reqs, args.max_model_len)
    results["pagedserve"] = paged
    paged["dtype"] = engine.config.model.dtype  # what --dtype resolved to
    paged["quantization"] = engine.config.model.quantization
    paged["kv_cache_dtype"] = args.kv_cache_dtype
    capacity = engine.kv.num_blocks * engine.kv.block_size
    results["contiguous_max_len_requests_fitting_pool"] = capacity // args.max_model_len
    print(f"pagedserve:   {paged['output_tokens_per_s']:7.2f} output tok/s  ({paged['wall_s']:.1f} s, "
          f"{paged['num_steps']} steps, {paged['num_preemptions']} preemptions)", flush=True)
    del llm, engine
    gc.collect()
    if args.also_dtype or args.also_quantization:
        other_llm = make_llm(args.also_dtype or args.dtype, args.also_quantization or args.quantization)
        other = run_pagedserve(other_llm, reqs, args.max_model_len)
        other["dtype"] = other_llm.llm_engine.config.model.dtype
        other["quantization"] = other_llm.llm_engine.config.model.quantization
        label = "_".join(f"{k}={v}" for k, v in (("dtype", args.also_dtype), ("q", args.also_quantization)) if v)
        ratio = paged["output_tokens_per_s"] / other["output_tokens_per_s"]
        results[f"pagedserve_{label}"], results[f"ratio_vs_{label}"] = other, ratio
        print(f"pagedserve {label}: {other['output_tokens_per_s']:7.2f} output tok/s ({other['wall_s']:.1f} s); "
              f"the first run is {ratio:.2f}x", flush=True)
        del other_llm
        gc.collect()

    if not args.skip_hf:
        hf = run_transformers(reqs, args.hf_batch_size, pad_id)
        results["transformers"] = hf
        results["ratio_output_tokens_per_s"] = paged["output_tokens_per_s"] / hf["output_tokens_per_s"]
        # Per CPU-second of this process: less sensitive to other processes taking the cores.
        results["ratio_output_tokens_per_cpu_s"] = (paged["output_tokens_per_cpu_s"]
                                                    / hf["output_tokens_per_cpu_s"])
        print(f"transformers: {hf['output_tokens_per_s']:7.2f} output tok/s  ({hf['wall_s']:.1f} s, static "
              f"batches of {args.hf_batch_size}, {hf['generated_tokens_incl_discarded']} tokens generated)")
        print(f"ratio pagedserve / transformers: {results['ratio_output_tokens_per_s']:.2f}x "
              f"(per CPU-second: {results['ratio_output_tokens_per_cpu_s']:.2f}x)")

    waste = paged["kv_waste"]
    print(f"KV waste (allocated but unused / allocated), over {waste['num_samples']} steps:")
    for name in KVWasteSampler.SYSTEMS:
        w = waste[name]
        print(f"  {name:20s} time-avg {w['time_avg_waste']:6.1%}   at peak allocation {w['peak_time_waste']:6.1%}"
              f"   (peak {w['peak_allocated_slots']} slots)")
    machine["load_avg_1_5_15_end"] = list(os.getloadavg())
    results["machine"] = machine
    if args.out:
        write_json(args.out, results)
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
