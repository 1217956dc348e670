"""Where one step of a GGUF goes: per-step milliseconds by part, against the weight floor.

    python benchmarks/decode_breakdown.py --model /work/models/llama-3.2-1b-Q4_K_M.gguf --order 1,0 \
        --out benchmarks/results/decode_breakdown_1b_q4km.json
    python benchmarks/decode_breakdown.py --model ... --order 1 --step prefill   # one 512-token prompt's step
    python benchmarks/decode_breakdown.py --model ... --order 1 --step mixed     # 16 decoding + a 512 prefill

--step decode (default, below); --step prefill and --step mixed (benchmarks/step_breakdown.py): one engine
step of --prefill-tokens prompt tokens, alone or beside --decoding requests that each decode one token (the
16-stream workload's steady state under the adaptive budget's 512-token floor), timed in turns with and
without the profiler, GEMMs named by their layer (qkv, o, gate_up, down, lm_head).

Each PAGEDSERVE_GGUF_INT8 value of --order runs in its own process (the dispatcher reads it once), in turns:
one stream, a 32-token prompt, --tokens greedy tokens, first untimed, then timed without a profiler (TPOT: wall
time of the decode steps / steps) and once more under torch.profiler. Op self times per step:
  gemm <kernel> <type>   the decoder's block GEMMs (type from the weight's bytes per row)
  lm_head <kernel> <type> the GEMM whose rows are the vocabulary
  attention, norms+rotary+silu, other ops
  outside ops            the step's wall time less every op: Python, the engine, sampling's Python side
and the floor: the bytes of the weights one step reads (every linear + the LM head) at the copy bandwidth
measured in the same run (common.memory_bandwidth). Also the process's CPU milliseconds per step (all threads;
the prompt's step spread over the others): on a shared machine, where OpenMP threads wait for time slices and
wall times mean little, `--threads 1` and the CPU time with the ops' shares still account for a step.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

from common import int8_child_run, machine_info, memory_bandwidth, write_json

# bytes per 256 weights of each k-quant and per 32 of the rest: names the type from a weight's row bytes
# (Q4_0's 8 x 18 bytes equal Q4_K's 144: the k-quant is named)
BYTES_PER_256 = {8 * 20: "Q4_1", 8 * 22: "Q5_0", 8 * 24: "Q5_1", 8 * 34: "Q8_0", 144: "Q4_K", 176: "Q5_K",
                 210: "Q6_K", 136: "IQ4_XS"}


PROMPT_LEN = 32


def group(name: str, shapes, vocab: int) -> str:
    op = name.split("::")[-1]
    if op.startswith("gemm_gguf"):
        (_, k), (rows, row_bytes) = shapes[0], shapes[1]
        kind = "int8" if op.endswith("int8") else "gemv"
        qtype = BYTES_PER_256.get(row_bytes * 256 // k, f"{row_bytes} B/row")
        return f"{'lm_head' if rows == vocab else 'gemm'} {kind} {qtype}"
    if op == "paged_attention":
        return "attention"
    if op in ("rms_norm", "fused_add_rms_norm_", "rotary_embedding_", "silu_and_mul"):
        return "norms+rotary+silu"
    if op == "decoder_layers":
        return "decoder_layers (self)"
    return "other ops"


def run_one(model: str, tokens: int, threads: int) -> dict:
    import torch

    from pagedserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model=model, max_model_len=256, enable_prefix_caching=False)
    vocab = llm.llm_engine.hf_config.vocab_size
    prompt = {"prompt_token_ids": list(range(1000, 1000 + PROMPT_LEN))}
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up

    def tpot() -> float:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return (out.metrics.last_token_time - out.metrics.first_token_time) / (tokens - 1) * 1e3

    plain, cpu = [], []
    for _ in range(2):
        start = time.process_time()
        plain.append(tpot())
        cpu.append((time.process_time() - start) / tokens * 1e3)  # the prompt's step included
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        profiled = tpot()
    parts: dict[str, float] = collections.defaultdict(float)
    for e in prof.key_averages(group_by_input_shape=True):
        if e.input_shapes and e.input_shapes[0] and e.input_shapes[0][0] == PROMPT_LEN:
            continue  # the prefill step's ops (TPOT leaves it out too)
        if "::" in e.key:
            parts[group(e.key, e.input_shapes, vocab) if e.key.startswith("pagedserve") else "other ops"] += (
                e.self_cpu_time_total / 1e3)
    steps = tokens - 1  # decode steps
    return {"tpot_ms": [round(t, 2) for t in plain], "tpot_profiled_ms": round(profiled, 2),
            "cpu_ms_per_step": [round(t, 2) for t in cpu],
            "dtype": str(llm.llm_engine.config.dtype) if hasattr(llm.llm_engine.config, "dtype") else None,
            "ms_per_step": {k: round(v / steps, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}}


def weight_bytes(model: str) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(model)
    # every 2-D tensor is read once per step (the tied embedding as the LM head), except the embedding lookup
    names = {t.name for t in reader.tensors}
    return sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 2
               and not (t.name == "token_embd.weight" and "output.weight" in names))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--order", default="1,0", help="PAGEDSERVE_GGUF_INT8 values, run in this order; with "
                   "--step prefill/mixed int8:Q4_1 or bf16@16:Q4_1+Q8_0 also send those types through that path")
    p.add_argument("--step", choices=("decode", "prefill", "mixed"), default="decode")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--prompts", type=int, default=1, help="--step prefill/mixed: prompts sharing --prefill-tokens")
    p.add_argument("--decoding", type=int, default=16, help="--step mixed: requests decoding beside the prefill")
    p.add_argument("--dtype", default="auto", help="--step prefill/mixed: the engine's --dtype")
    p.add_argument("--repeats", type=int, default=3, help="--step prefill/mixed: timed steps per process")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args()
    if args.step != "decode":
        from step_breakdown import main as step_main

        return step_main(args)
    if args.child:
        print(json.dumps(run_one(args.model, args.tokens, args.threads)))
        return
    result = {"command": " ".join(sys.argv), "load_avg_before": os.getloadavg(), "runs": []}
    bandwidth = memory_bandwidth(num_threads=args.threads)
    floor_ms = weight_bytes(args.model) / (bandwidth["copy_gb_per_s"] * 1e9) * 1e3
    result.update(bandwidth=bandwidth, weight_bytes=weight_bytes(args.model), floor_ms=round(floor_ms, 2))
    print(f"weights {result['weight_bytes'] / 1e6:.0f} MB per step, copy {bandwidth['copy_gb_per_s']:.1f} GB/s: "
          f"floor {floor_ms:.1f} ms", flush=True)
    for value in args.order.split(","):
        run = int8_child_run(__file__, value)
        ops_ms = sum(run["ms_per_step"].values())
        run["ms_per_step"]["outside ops"] = round(run["tpot_profiled_ms"] - ops_ms, 3)
        result["runs"].append(run)
        print(f"int8={value}: TPOT {run['tpot_ms']} ms (profiled {run['tpot_profiled_ms']}), CPU "
              f"{run['cpu_ms_per_step']} ms per step, "
              f"{100 * floor_ms / min(run['tpot_ms']):.0f}% of the floor", flush=True)
        for k, v in run["ms_per_step"].items():
            print(f"    {k:28s} {v:8.2f} ms", flush=True)
    if args.out:
        write_json(args.out, dict(result, load_avg_after=os.getloadavg(), machine=machine_info()))


if __name__ == "__main__":
    main()
