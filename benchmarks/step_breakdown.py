"""decode_breakdown.py --step prefill|mixed: where one prefill or prefill+decode engine step goes.

One engine (LLM.llm_engine, stepped by hand), --threads threads, --dtype. prefill: --prefill-tokens in --prompts
prompts
(max_tokens 1: the step samples its one token). mixed: first --decoding requests with 64-token prompts start
decoding, then each timed step adds one --prefill-tokens prompt beside them (the 16-stream workload's steady
state: 16 decoding requests leave the adaptive budget at its 512-token floor). Every prompt is new random
tokens (no prefix cache). Each of --repeats rounds times one plain step (wall and the process's CPU time, all
threads) and then one under torch.profiler, whose op self times are grouped:
  <layer> <kernel> <type>   the block GEMMs by layer: qkv, o, gate_up, down, lm_head (from the weight's shape)
  attention, norms+rotary+silu, sampling ops, other ops
  outside ops               the step's wall time less every op: Python, scheduling, the engine
Without a block kernel for the rows (float path), a weight runs as "tiles: dequantize" + "tiles: torch GEMM".
--order int8:Q4_1 or bf16@16:Q4_1+Q8_0 also sends those types through gemm_gguf_int8 / gemm_gguf_bf16 (A/B).
Per-op times are wall times of the calling thread (2 threads inside an op count once): on a loaded machine
compare the CPU time per step and the shares, in turns (--order 1,0,1,0).
"""
from __future__ import annotations

import collections
import json
import os
import random
import sys
import time

from common import int8_child_run, machine_info, write_json
from decode_breakdown import BYTES_PER_256

TORCH_GEMM_OPS = ("mm", "addmm", "matmul", "linear", "bmm")
SAMPLING_OPS = ("argmax", "topk", "sort", "softmax", "log_softmax", "exponential_", "multinomial")


def layer_of(rows: int, k: int, cfg) -> str:
    if rows == cfg.vocab_size:
        return "lm_head"
    if k == cfg.intermediate_size:
        return "down"
    if rows in (cfg.intermediate_size, 2 * cfg.intermediate_size):
        return "gate_up"
    return "o" if rows == cfg.hidden_size else "qkv"


def group(name: str, shapes, cfg) -> str:
    op = name.split("::")[-1]
    if name.startswith("pagedserve") and op.startswith("gemm_gguf") and len(shapes) > 1 and len(shapes[1]) == 2:
        (_, k), (rows, row_bytes) = shapes[0], shapes[1]
        kind = op.removeprefix("gemm_gguf_") if op != "gemm_gguf" else "float"  # int8, bf16, amx
        qtype = BYTES_PER_256.get(row_bytes * 256 // k, f"{row_bytes} B/row")
        return f"{layer_of(rows, k, cfg)} {kind} {qtype}"
    if op.startswith("paged_attention"):
        return "attention"
    if op in ("rms_norm", "fused_add_rms_norm_", "rotary_embedding_", "silu_and_mul"):
        return "norms+rotary+silu"
    if op == "decoder_layers":
        return "decoder_layers (self)"
    if op in SAMPLING_OPS:
        return "sampling ops"
    if op == "dequant_gguf" and len(shapes) > 0 and shapes[0] and shapes[0][0] != cfg.vocab_size:
        return "tiles: dequantize"  # the weight tiles of the float path (model/layers/gguf_quant.py)
    if op in TORCH_GEMM_OPS:
        return "tiles: torch GEMM"
    if op in ("copy_", "_to_copy", "to"):
        return "copies and casts"
    return "other ops"


def extra_types(order_value: str) -> None:
    # --order int8:Q4_1 (int8 on, and Q4_1 also in INT8_TYPES: gemm_gguf_int8 from INT8_MIN_ROWS rows of x), or
    # bf16@16:Q4_1+Q8_0 (those types also in BF16_TYPES, with BF16_MIN_ROWS 16, where the dispatcher has them):
    # an A/B of types the dispatcher does not choose, patched before any weight is dispatched.
    if ":" not in order_value:
        return
    from pagedserve.model.layers import gguf_quant

    path, types = order_value.split(":")
    path, _, rows = path.partition("@")
    names = {v[0]: k for k, v in gguf_quant.GGUF_BLOCK_TYPES.items()}
    attr = {"int8": "INT8_TYPES", "bf16": "BF16_TYPES"}[path]
    setattr(gguf_quant, attr, getattr(gguf_quant, attr) + tuple(names[n] for n in types.split("+")))
    if rows:
        setattr(gguf_quant, f"{path.upper()}_MIN_ROWS", int(rows))
        if path == "bf16":
            gguf_quant.BF16_MIN_ROWS_AMX = int(rows)


def run_steps(args) -> dict:
    import torch

    from pagedserve import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    extra_types(os.environ.get("PAGEDSERVE_GGUF_INT8", "1"))
    llm = LLM(model=args.model, max_model_len=2048, enable_prefix_caching=False, dtype=args.dtype,
              max_num_seqs=max(64, args.decoding + 1))
    engine = llm.llm_engine
    cfg = engine.hf_config
    rng = random.Random(0)
    ids = iter(range(10**9))

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(1000, min(cfg.vocab_size, 40000)) for _ in range(n)]}

    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    if args.step == "mixed":
        long_decode = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
        for _ in range(args.decoding):
            engine.add_request(str(next(ids)), prompt(64), long_decode)
        engine.step()  # their prompts (16 x 64 fit the budget), then warm decode steps
        engine.step()

    def one_step() -> tuple[float, float, int]:
        pending = set()
        for _ in range(args.prompts):  # --prefill-tokens split evenly over --prompts prompts
            pending.add(str(next(ids)))
            engine.add_request(max(pending, key=int), prompt(args.prefill_tokens // args.prompts), greedy)
        steps, wall, cpu = 0, 0.0, 0.0
        while True:  # the new prompts' step (one, unless the budget splits them: then all of them)
            w0, c0 = time.perf_counter(), time.process_time()
            outs = engine.step()
            wall, cpu, steps = wall + time.perf_counter() - w0, cpu + time.process_time() - c0, steps + 1
            pending -= {o.request_id for o in outs if o.finished}
            if not pending:
                return wall * 1e3, cpu * 1e3, steps

    walls, cpus, profiled, parts_total = [], [], [], collections.defaultdict(float)
    for r in range(args.repeats + 1):  # round 0 warms up
        wall, cpu, steps = one_step()
        if r:
            walls.append(round(wall, 1)), cpus.append(round(cpu, 1))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            wall_p, _, steps_p = one_step()
        if not r:
            continue
        profiled.append(round(wall_p, 1))
        parts: dict[str, float] = collections.defaultdict(float)
        for e in prof.key_averages(group_by_input_shape=True):
            if "::" in e.key:
                parts[group(e.key, e.input_shapes, cfg)] += e.self_cpu_time_total / 1e3
        parts["outside ops"] = wall_p - sum(parts.values())
        for k, v in parts.items():
            parts_total[k] += v / args.repeats
    return {"step": args.step, "prefill_tokens": args.prefill_tokens, "prompts": args.prompts, "dtype": engine.config.model.dtype,
            "decoding": args.decoding if args.step == "mixed" else 0, "threads": args.threads,
            "engine_steps_per_prompt": steps, "wall_ms": walls, "cpu_ms": cpus, "wall_profiled_ms": profiled,
            "ms_per_step": {k: round(v, 2) for k, v in sorted(parts_total.items(), key=lambda kv: -kv[1])}}


def main(args) -> None:
    if args.child:
        print(json.dumps(run_steps(args)))
        return
    result = {"command": " ".join(sys.argv), "load_avg_before": os.getloadavg(), "runs": []}
    for value in args.order.split(","):
        run = int8_child_run(os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_breakdown.py"),
                             value)
        result["runs"].append(run)
        print(f"int8={value} {run['step']} ({run['prefill_tokens']} prompt tokens + {run['decoding']} decoding, "
              f"{run['engine_steps_per_prompt']} engine step(s)): wall {run['wall_ms']} ms, CPU {run['cpu_ms']} ms, "
              f"profiled {run['wall_profiled_ms']} ms; load {os.getloadavg()[0]:.1f}", flush=True)
        total = sum(run["ms_per_step"].values())
        for k, v in run["ms_per_step"].items():
            print(f"    {k:28s} {v:8.2f} ms {100 * v / total:5.1f}%", flush=True)
    if args.out:
        write_json(args.out, dict(result, load_avg_after=os.getloadavg(), machine=machine_info()))
