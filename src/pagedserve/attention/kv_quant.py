"""8-bit KV cache storage (kv_dtypes.py describes the formats): quantize rows on write, dequantize on read.

A quantized layer cache is [2, num_blocks, block_size, num_kv_heads, head_dim + 4] of torch.int8 (int8) or
torch.float8_e4m3fn (fp8_e4m3): head_dim codes, then the row's float32 scale as 4 raw bytes. The storage dtype
says which format a cache holds, so backends need no extra argument. value = code * scale.
"""
from __future__ import annotations

import torch

from pagedserve.kv_dtypes import SCALE_BYTES

STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int8": torch.int8, "fp8_e4m3": getattr(torch, "float8_e4m3fn", None)}
_QMAX = {torch.int8: 127.0}
if STORAGE["fp8_e4m3"] is not None:
    _QMAX[STORAGE["fp8_e4m3"]] = float(torch.finfo(STORAGE["fp8_e4m3"]).max)  # 448


def storage_dtype(kv_dtype: str) -> torch.dtype:
    dtype = STORAGE[kv_dtype]
    if dtype is None:
        raise ValueError(f"--kv-cache-dtype {kv_dtype}: this torch build has no float8_e4m3fn; valid values: "
                         "auto, float32, bfloat16, int8")
    return dtype


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    # Elements in one cache row (the last dimension) for storage `dtype`.
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def head_dim_of(kv_cache: torch.Tensor) -> int:
    width = kv_cache.shape[-1]
    return width - SCALE_BYTES if is_quantized(kv_cache.dtype) else width


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # [..., D] floats -> [..., D + 4] rows of `dtype` (codes, then the float32 scale's bytes).
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / _QMAX[dtype]
    q = x / scale
    codes = q.round_().clamp_(-127, 127).to(torch.int8) if dtype == torch.int8 else q.to(dtype)
    return torch.cat((codes.view(torch.uint8), scale.view(torch.uint8)), dim=-1).view(dtype)


def dequantize(rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    # [..., D + 4] rows -> [..., D] of out_dtype.
    raw = rows.view(torch.uint8)
    scale = raw[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].to(torch.float32) * scale).to(out_dtype)
