"""Decode block GEMM (kernels/csrc/gguf_decode.h) against the other paths over GGUF blocks, per rows of x.

    python benchmarks/gguf_gemv.py                         # rows 1,2,4,8,16,32,64; 2 threads; 5 rounds
    python benchmarks/gguf_gemv.py --rows 1,16 --threads 1
    python benchmarks/gguf_gemv.py --rows 1,2,4,8 --out benchmarks/results/gguf_gemv.json
    python benchmarks/gguf_gemv.py --model llama1b --types Q4_K,Q6_K --rows 1,4,8,16 --isas baseline
    python benchmarks/gguf_gemv.py --model llama1b --prefill --types Q4_K,Q6_K    # rows 64 .. 2048, bf16 x
    python benchmarks/gguf_gemv.py --model llama1b --prefill --types Q4_K,Q6_K --rows 128,512,1024 --threads 1 \
        --paths "mm bf16,int8 bf16,brgemm bf16" --shapes qkv_proj,o_proj,gate_up_proj,down_proj,lm_head --vocab 128256

--model smollm (default): the embedded model's shapes (SmolLM2-135M: hidden 576, intermediate 1536, vocab
49152; Q4_1 layers, the tied LM head Q8_0) with random blocks. --model llama1b: Llama-3.2-1B's (hidden 2048,
8 KV heads of 64, intermediate 8192, SmolLM2's vocab of 49152 for the LM head) in each of --types (random
bytes: the time does not depend on the values). --isas adds gemm_gguf on float32 x of other kernel variants
(baseline: the portable loop) as columns. Weights are cold as in a decode step: every call takes the next of copies
spanning about the model's size (96 MB), so a weight is evicted from L2 before it is read again. Prints
microseconds per call, the median over rounds that interleave the paths:
  gemv bf16   gemm_gguf on bf16 x (bf16 out): what `--dtype auto` runs for few rows
  amx bf16    gemm_gguf_amx (amx variant only): bf16 tiles, the bf16 path for more rows
  gemv f32    gemm_gguf on float32 x
  tiles f32   float32 tiles dequantized per call + torch's GEMM: the float32 path for many rows
  int8 f32    gemm_gguf_int8 on float32 x (x quantized to int8 per call; every variant but baseline): what
              the dispatcher runs for Q4_K, Q5_K, Q6_K from 1 row (avx512, amx: 1-4 rows through the
              few-row kernel, csrc/gguf_int8_gemv.h) or 5 rows (avx2), for IQ4_XS from 1 row and Q8_0 at
              1-2 rows (VNNI: csrc/gguf_int8_gemv.h), unless PAGEDSERVE_GGUF_INT8=0
--prefill (llama1b; rows 64,128,256,512,1024,2048 unless --rows): prompt-sized x in bf16, what `--dtype auto`
runs on CPUs without AMX, the LM head left out (a prefill multiplies only its sampled rows):
  tiles bf16  bf16 tiles dequantized per call + torch's bf16 GEMM: the path PAGEDSERVE_GGUF_INT8=0 takes
  int8 bf16   gemm_gguf_int8 on bf16 x (from 32 rows the register tiles of csrc/gguf_int8_tiles.h)
  brgemm bf16 gemm_gguf_bf16 (csrc/gguf_bf16.cpp; CPUs with AVX512-BF16 or AMX): bf16 panels rebuilt per call
              and oneDNN's brgemm micro-kernel
  rebuild+mm bf16  the whole weight rebuilt as bf16 per call (dequant_gguf_bf16) and torch.mm: the panels' rival
  mm bf16     torch.mm on the weight already in bf16 (dequantized once, outside the timing; weights warm):
              the dense bf16 GEMM a bf16 checkpoint runs, what the others are measured against
--paths picks among these; the shapes are the fused ones (qkv_proj, gate_up_proj) unless --shapes names the
unfused ones, and lm_head (--vocab rows; 49,152 in the benchmark models) only where --shapes names it. Per path
GMAC/s of wall time, GMAC per CPU second (the machine may be shared: this is the figure that survives load),
and "busy" (CPU seconds per wall second: 2.0 when both threads of --threads 2 work). Then per shape the cost
of rebuilding the weight as bf16, CPU ns per weight: dequant_gguf + .to(bfloat16) (the tiles' way) and
dequant_gguf_bf16 (the panels' rebuild).
Then GB/s: the weight bytes read per second by each path. Run with another checkout's interpreter to time its
gemm_gguf (paths it lacks are left out). --out also writes the table as JSON, with the load average before
and after (the machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedserve import kernels
from pagedserve.model.layers.gguf_quant import GGUF_BLOCK_TYPES, GGUFWeight, gguf_dequantize, row_bytes

SHAPES = [("qkv_proj", 960, 576, GGMLQuantizationType.Q4_1), ("o_proj", 576, 576, GGMLQuantizationType.Q4_1),
          ("gate_up_proj", 3072, 576, GGMLQuantizationType.Q4_1), ("down_proj", 576, 1536, GGMLQuantizationType.Q4_1),
          ("lm_head", 49152, 576, GGMLQuantizationType.Q8_0)]
# (name, rows, cols) of Llama-3.2-1B; each is timed in every type of --types
LLAMA_1B_SHAPES = [("q/o_proj", 2048, 2048), ("k/v_proj", 512, 2048), ("gate/up_proj", 8192, 2048),
                   ("down_proj", 2048, 8192), ("lm_head", 49152, 2048)]
# --prefill: the fused projections a prefill step multiplies (lm_head only when --shapes names it)
LLAMA_1B_PREFILL_SHAPES = [("qkv_proj", 3072, 2048), ("o_proj", 2048, 2048), ("gate_up_proj", 16384, 2048),
                           ("down_proj", 2048, 8192), ("lm_head", 49152, 2048)]
PREFILL_PATHS = ("tiles bf16", "int8 bf16", "brgemm bf16", "mm bf16")
SPAN_BYTES = 96 << 20


def copies(rows: int, cols: int, qtype, quantized: bool = True) -> list[torch.Tensor]:
    if quantized:
        raw = torch.from_numpy(quantize(
            np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32) * 0.1, qtype))
    else:
        raw = torch.randint(0, 256, (rows, row_bytes(int(qtype), cols)), dtype=torch.uint8)
    return [raw.clone() for _ in range(max(2, SPAN_BYTES // raw.numel()))]


def paths(ops, qtype: int, cols: int, other_isas: list[str]):
    # name -> fn((x float32, x bf16), w); a path this build lacks is left out.
    out = {}
    try:
        ops.gemm_gguf(torch.zeros(1, 32).bfloat16(), torch.zeros(1, 20, dtype=torch.uint8), 3, None)
        out["gemv bf16"] = lambda x, w: ops.gemm_gguf(x[1], w, qtype, None)
    except RuntimeError:
        pass
    if hasattr(ops, "gemm_gguf_amx"):
        out["amx bf16"] = lambda x, w: ops.gemm_gguf_amx(x[1], w, qtype, None)
    out["gemv f32"] = lambda x, w: ops.gemm_gguf(x[0], w, qtype, None)
    out["tiles f32"] = lambda x, w: x[0] @ gguf_dequantize(GGUFWeight((qtype,), (w,), cols)).t()
    out["tiles bf16"] = lambda x, w: x[1] @ gguf_dequantize(GGUFWeight((qtype,), (w,), cols)).to(x[1].dtype).t()
    if hasattr(ops, "gguf_int8_types") and qtype in ops.gguf_int8_types():
        out["int8 f32"] = lambda x, w: ops.gemm_gguf_int8(x[0], w, qtype, None)
        out["int8 bf16"] = lambda x, w: ops.gemm_gguf_int8(x[1], w, qtype, None)
    if hasattr(ops, "gguf_bf16_types") and qtype in ops.gguf_bf16_types():
        out["brgemm bf16"] = lambda x, w: ops.gemm_gguf_bf16(x[1], w, qtype, None)
        out["rebuild+mm bf16"] = lambda x, w: x[1] @ ops.dequant_gguf_bf16(w, qtype).t()
    for name in other_isas:
        other = kernels.load_isa(name)
        out[f"f32 {name}"] = lambda x, w, other=other: other.gemm_gguf(x[0], w, qtype, None)
    return out


def rebuild_cost(ops, qtype: int, cols: int, ws: list[torch.Tensor]) -> dict[str, float]:
    # CPU ns per weight to rebuild the weight as bf16: dequant_gguf + .to(bfloat16), and dequant_gguf_bf16 where built
    fns = {"dequant_gguf + to(bf16)": lambda x, w: gguf_dequantize(GGUFWeight((qtype,), (w,), cols)).bfloat16()}
    if hasattr(ops, "gguf_bf16_types") and qtype in ops.gguf_bf16_types():
        fns["dequant_gguf_bf16"] = lambda x, w: ops.dequant_gguf_bf16(w, qtype)
    out, pos = {}, 0
    for p, fn in fns.items():
        us = []
        for _ in range(3):
            t, pos, cpu = time_path(fn, (None, None), ws, pos)
            us.append(t * cpu)
        out[p] = round(statistics.median(us) * 1e3 / ws[0].shape[0] / cols, 3)
    print("  rebuild as bf16, CPU ns per weight: " + ", ".join(f"{p} {v}" for p, v in out.items()))
    return out


def time_path(fn, x: tuple[torch.Tensor, torch.Tensor], ws: list[torch.Tensor], start: int,
              budget_s: float = 0.03) -> tuple[float, int, float]:
    # Microseconds per call over consecutive copies from `start`; returns (us, next start, CPU s per wall s).
    calls, t0, c0 = 0, time.perf_counter(), time.process_time()
    while True:
        fn(x, ws[(start + calls) % len(ws)])
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= budget_s and calls >= 3:
            return elapsed / calls * 1e6, start + calls, (time.process_time() - c0) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", help="rows of x (default 1,2,4,8,16,32,64; with --prefill 64,...,2048)")
    ap.add_argument("--prefill", action="store_true", help="llama1b: bf16 tiles against int8 at prompt sizes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", help="names of the shapes to time (default: all of the model's)")
    ap.add_argument("--model", choices=("smollm", "llama1b"), default="smollm")
    ap.add_argument("--types", default=",".join(t[0] for t in GGUF_BLOCK_TYPES.values()), help="llama1b's types")
    ap.add_argument("--isas", default="", help="other kernel variants whose gemm_gguf f32 to time too")
    ap.add_argument("--paths", default=",".join(PREFILL_PATHS[:3]), help="--prefill: the paths to time")
    ap.add_argument("--vocab", type=int, default=49152, help="llama1b: the LM head's rows")
    ap.add_argument("--out", help="also write the results as JSON here")
    args = ap.parse_args()
    args.rows = args.rows or ("64,128,256,512,1024,2048" if args.prefill else "1,2,4,8,16,32,64")
    result = {"command": " ".join(sys.argv), "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
              "load_avg_before": os.getloadavg(), "threads": args.threads, "rounds": args.rounds, "unit": "us per call",
              "shapes": {}}
    torch.set_num_threads(args.threads)
    ops = kernels.load()
    result["variant"], result["kernels"] = kernels.selected_isa(), os.path.dirname(kernels.__file__)
    print(f"variant {result['variant']}, {args.threads} threads; us per call, median of {args.rounds} rounds")
    if args.model == "smollm":
        shapes = SHAPES
    else:
        listed = LLAMA_1B_SHAPES
        if args.prefill:
            named = (args.shapes or "").split(",")
            listed = [s for s in LLAMA_1B_PREFILL_SHAPES if s[0] != "lm_head" or "lm_head" in named]
            if set(named) & {"q/o_proj", "k/v_proj", "gate/up_proj"}:
                listed = LLAMA_1B_SHAPES
        shapes = [(f"{name} {t}", args.vocab if name == "lm_head" else rows, cols, GGMLQuantizationType[t])
                  for name, rows, cols in listed for t in args.types.split(",")]
    for name, rows, cols, qtype in shapes:
        if args.shapes and name.split(" ")[0] not in args.shapes.split(","):
            continue
        ws = copies(rows, cols, qtype, quantized=args.model == "smollm")
        fns = paths(ops, int(qtype), cols, [i for i in args.isas.split(",") if i])
        if args.prefill:
            wanted = args.paths.split(",")
            if "mm bf16" in wanted:
                dense = gguf_dequantize(GGUFWeight((int(qtype),), (ws[0],), cols)).bfloat16()
                fns["mm bf16"] = lambda x, w, dense=dense: x[1] @ dense.t()
            fns = {p: fns[p] for p in wanted if p in fns}
            result.setdefault("rebuild ns per weight", {})[name] = rebuild_cost(ops, int(qtype), cols, ws)
        elif args.model == "llama1b":  # gemm_gguf f32 only: dequantizing a 49152 x 2048 LM head per call is 400 MB
            fns = {p: fn for p, fn in fns.items() if p in ("gemv f32", "int8 f32") or p.startswith("f32 ")}
        else:
            fns = {p: fn for p, fn in fns.items() if p not in ("tiles bf16", "int8 bf16")}
        gigabytes = ws[0].numel() / 1e9
        unit = "GMAC/s" if args.prefill else "GB/s of weights"
        print(f"\n{name} [{rows} x {cols}] {qtype.name}, {len(ws)} copies; us per call ({unit})")
        print("rows " + "".join(f"{p:>34}" for p in fns))
        table = result["shapes"][name] = {"rows": rows, "cols": cols, "type": qtype.name, "us": {}, "GB/s": {},
                                          "busy": {}}
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, cols)
            x = (x, x.bfloat16())
            times: dict[str, list[float]] = {p: [] for p in fns}
            busy: dict[str, list[float]] = {p: [] for p in fns}
            pos = 0
            for _ in range(args.rounds):
                for p, fn in fns.items():
                    us, pos, cpu = time_path(fn, x, ws, pos)
                    times[p].append(us)
                    busy[p].append(cpu)
            table["us"][m] = {p: round(statistics.median(t), 1) for p, t in times.items()}
            table["GB/s"][m] = {p: round(gigabytes / (us * 1e-6), 2) for p, us in table["us"][m].items()}
            table["busy"][m] = {p: round(statistics.median(b), 2) for p, b in busy.items()}
            line = "".join(f"{us:>12.1f} ({table['GB/s'][m][p]:>5.1f})" for p, us in table["us"][m].items())
            if args.prefill:  # GMAC/s (wall; per CPU second) instead of weight GB/s, and how busy the threads were
                gmac = {p: rows * cols * m / (us * 1e3) for p, us in table["us"][m].items()}
                table.setdefault("GMAC/s", {})[m] = {p: round(g, 1) for p, g in gmac.items()}
                table.setdefault("GMAC per CPU s", {})[m] = {p: round(g / max(table["busy"][m][p], 1e-3), 1)
                                                             for p, g in gmac.items()}
                per_cpu, busy_m = table["GMAC per CPU s"][m], table["busy"][m]
                line = "".join(f"{us:>9.0f} ({gmac[p]:>4.0f} {per_cpu[p]:>4.0f}/cpu b{busy_m[p]:.1f})"
                               for p, us in table["us"][m].items())
            print(f"{m:>4} " + line, flush=True)
    result["load_avg_after"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
