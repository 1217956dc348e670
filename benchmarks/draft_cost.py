"""Why a requantized self-draft is cheaper on some CPUs: one layer's linears of the embedded model (Q4_1) at
1 and 5 rows through each weight path, best of 30 interleaved calls (robust to other jobs on the machine).

    python benchmarks/draft_cost.py --num-threads 1

On AVX2 without AVX-512 the Q4_1 block kernel has no vector path (kernels/csrc/quant_gemm.cpp), while the
Q8_0 one auto-vectorizes: a Q8_0 copy of the same weights is what draft_model's "quantization": "int8" runs.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from pagedserve import kernels
from pagedserve.model.layers.quant import quantize_q8_0
from pagedserve.model.loader import load_model


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
    model = load_model(None, quantization="none").model
    layer = model.model.layers[0]
    print("isa", kernels.selected_isa(), "load", os.getloadavg())
    for name, m in layer.named_modules():
        if getattr(m, "exact_blocks", None) is None or m.exact_blocks[0] != "q4_1":
            continue
        w, (qs, dm) = m.weight, m.exact_blocks[1]
        q8 = quantize_q8_0(w)
        for rows in (1, 5):
            x = torch.randn(rows, w.shape[1])
            us = best_us({"q4_1 (target)": lambda: ops.gemm_q4_1(x, qs, dm, None),
                          "q8_0 (int8 draft)": lambda: ops.gemm_q8_0(x, *q8, None),
                          "fp32 dense": lambda: torch.nn.functional.linear(x, w)}, args.reps)
            print(f"{name:22s} {tuple(w.shape)} rows={rows}: {us} us")


if __name__ == "__main__":
    main()
