"""CPU paged attention: the compiled kernel reads K/V through block tables in place (no gathered copies).

One kernel call per layer writes this step's K/V and attends every sequence, decode and prefill chunks
alike (kernels/csrc/paged_attention.cpp). Measured against the reference backend's gather + SDPA on one
core (benchmarks/HISTORY.md, "Profile"): decode 5-10x faster, prefill chunks of 16-512 tokens 1.2-2x, so
every sequence runs in the kernel (the op's max_q_len argument, which left longer chunks to SDPA, is always
-1: that split was used by tests only and is gone from Python). On CPUs with AMX the
bf16 prefill tiles run on AMX tiles: 3-3.7x the AVX-512 tiles (benchmarks/HISTORY.md, "AMX prefill attention").

The kernel takes float32 or bfloat16 activations and reads float32, bfloat16, int8 and fp8 e4m3 caches
directly (8-bit rows are quantized as they are written and dequantized in the kernel, with kv_quant.py's row
layout); anything else (float16) goes to the reference backend.

Sliding-window and soft-capped layers (Mistral v0.1, Gemma, Phi-3) run the same kernel with their window and
cap (paged_attention_windowed): a tile reads only the blocks inside its rows' windows.

batch_invariant (--batch-invariant): each query's output is the same whatever else shares the call (decoded alone,
verified with k speculative tokens, inside a prefill chunk of any length, beside sequences that share its prefix):
the kernel's invariant form (kernels/csrc/attention_tile.h), never the reference's SDPA.
"""
from __future__ import annotations

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.reference import ReferenceAttentionBackend

ALL_IN_KERNEL = -1  # the op's max_q_len: < 0 runs every sequence in the kernel
QUERY_DTYPES = (torch.float32, torch.bfloat16)
CACHE_DTYPES = tuple(d for d in (torch.float32, torch.bfloat16, torch.int8, getattr(torch, "float8_e4m3fn", None))
                     if d is not None)


def kernel_supports(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    return query_dtype in QUERY_DTYPES and cache_dtype in CACHE_DTYPES


class CpuPagedAttentionBackend:
    name = "cpu"

    def __init__(self, ops, sliding_window: int | None = None, logit_softcap: float | None = None,
                 batch_invariant: bool = False) -> None:
        self.ops = ops
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.batch_invariant = batch_invariant
        self._reference = ReferenceAttentionBackend(sliding_window, logit_softcap)

    def with_window(self, sliding_window: int | None, logit_softcap: float | None) -> CpuPagedAttentionBackend:
        return CpuPagedAttentionBackend(self.ops, sliding_window, logit_softcap, self.batch_invariant)

    def with_batch_invariance(self, on: bool) -> CpuPagedAttentionBackend:
        return CpuPagedAttentionBackend(self.ops, self.sliding_window, self.logit_softcap, on)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if query.device.type != "cpu" or not kernel_supports(query.dtype, kv_cache.dtype):
            return self._reference.forward(query, key, value, kv_cache, meta, scale)
        limit = ALL_IN_KERNEL
        if self.sliding_window is None and self.logit_softcap is None and not self.batch_invariant:
            out = self.ops.paged_attention(query, key, value, kv_cache, meta.slot_mapping, meta.block_tables,
                                           meta.seq_lens, meta.query_start_loc, scale, limit)
        else:
            out = self.ops.paged_attention_windowed(
                query, key, value, kv_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                meta.query_start_loc, scale, limit, self.sliding_window or 0, self.logit_softcap or 0.0,
                self.batch_invariant)
        return out
