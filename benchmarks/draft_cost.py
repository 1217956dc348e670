"""Why a requantized self-draft is cheaper on some CPUs: one layer's linears of the embedded model (Q4_1) at
1 and 5 rows through each weight path, best of 30 interleaved calls (robust to other jobs on the machine).

    python benchmarks/draft_cost.py --num-threads 1

The target runs the file's Q4_1 blocks; draft_model's "quantization": "int8" runs a Q8_0 copy of the same
weights (model/weight_quant.py); both through gemm_gguf.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from pagedserve import kernels
from pagedserve.model.loader import load_model
from pagedserve.model.weight_quant import quantize_q8_0


def best_us(fns: dict, reps: int) -> dict:
    best = {k: float("inf") for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    return {k: round(v * 1e6) for k, v in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)
    ops = kernels.load()
    if ops is None:
        raise SystemExit("the compiled kernels are unavailable here")
    model = load_model(None, quantization="gguf").model
    layer = model.model.layers[0]
    print("isa", kernels.selected_isa(), "load", os.getloadavg())
    for name, m in layer.named_modules():
        if getattr(m, "exact_blocks", None) is None or m.exact_blocks[1].qtypes != (3,):  # Q4_1
            continue
        q4 = m.exact_blocks[1].parts[0]
        w = ops.dequant_gguf(q4, 3)
        q8 = quantize_q8_0(w).parts[0]
        for rows in (1, 5):
            x = torch.randn(rows, w.shape[1])
            us = best_us({"q4_1 (target)": lambda: ops.gemm_gguf(x, q4, 3, None),
                          "q8_0 (int8 draft)": lambda: ops.gemm_gguf(x, q8, 8, None),
                          "fp32 dense": lambda: torch.nn.functional.linear(x, w)}, args.reps)
            print(f"{name:22s} {tuple(w.shape)} rows={rows}: {us} us")


if __name__ == "__main__":
    main()
