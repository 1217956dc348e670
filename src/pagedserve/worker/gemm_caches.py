"""A bound on the per-shape caches behind torch's CPU GEMMs, which otherwise grow with every new prompt length.

A bf16 matmul on the CPU (the GGUF tile path for more rows than the decode kernels take, gguf_quant.py) runs
through ideep and oneDNN, and each keeps what it built for every (rows, weight shape): ideep's LRU
(LRU_CACHE_CAPACITY) and oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1,024 entries each by
default, about 0.8 MB per row count and weight shape together. A server sees a new row count at nearly every
prefill, so its resident memory climbed with the requests: +88 MB over 60 mixed requests on the embedded model,
toward ~800 MB at the caps (benchmarks/memory_soak.py). A step's layers share their few GEMM shapes (4 on a Llama
layer), so CACHE_CAPACITY = 8 entries keep the last two row counts' primitives (~6 MB); a row count not kept
costs building its primitives again (~1 ms per GEMM shape per step, once for all layers; a new prompt length
cost that already). Variables the user set win. Read when a thread's first GEMM runs: set before the model's
first forward.
"""
from __future__ import annotations

import os

CACHE_CAPACITY = 8
# (oneDNN's primitive cache, ideep's cache of matmul descriptors); 0 crashes torch 2.13's bf16 matmul.
CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_gemm_caches() -> None:
    for name in CAPACITY_VARIABLES:
        os.environ.setdefault(name, str(CACHE_CAPACITY))
