"""Lossless block-quantized copies of float32 weights that are exactly GGUF Q4_1 / Q8_0 values.

A GGUF checkpoint's fp32 weights (what the loader dequantizes) are, block by block along the input dim,
`d * q + m` (Q4_1) or `d * q` (Q8_0) with fp16 d, m. find_q4_1 / find_q8_0 recover (q, d, m) from the fp32
tensor alone and return them only if they rebuild every weight bit for bit; otherwise None, and the layer
keeps its fp32 path. So the block copy is not an approximation: a kernel that rebuilds w = fma(d, q, m)
in registers (d * q is exact in fp32) multiplies by exactly the fp32 weights, reading 0.75 (Q4_1) or
1.125 (Q8_0) bytes per weight instead of 4. Decode at batch 1-4 is bound by reading the weights, so this
is what sets single-stream latency (kernels/csrc/quant_gemm.cpp).
"""
from __future__ import annotations

import torch

BLOCK = 32


def _blocks(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % BLOCK or weight.numel() == 0:
        return None
    return weight.detach().reshape(-1, BLOCK)


def _is_fp16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float() == x


def find_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(qs [N, K/2] uint8, dm [N, K/32, 2] float32) that rebuild `weight` exactly, or None."""
    blocks = _blocks(weight)
    if blocks is None:
        return None
    lo = blocks.amin(dim=1, keepdim=True)  # the block minimum is q = 0, so m is exactly the minimum
    hi = blocks.amax(dim=1, keepdim=True)
    if not bool(_is_fp16(lo).all()):
        return None
    d = torch.zeros_like(lo)
    q = torch.zeros_like(blocks, dtype=torch.uint8)
    todo = (hi > lo).squeeze(1)  # constant blocks: d = 0, q = 0
    # The largest weight is q = 15 in nearly every block; a few blocks top out lower, so try k = 15, 14, ...
    for k in range(15, 0, -1):
        if not bool(todo.any()):
            break
        idx = todo.nonzero().squeeze(1)
        b, m = blocks[idx], lo[idx]
        dk = ((hi[idx] - m) / k).half().float()
        qk = torch.round((b - m) / dk.clamp(min=torch.finfo(torch.float16).tiny)).clamp(0, 15)
        ok = ((dk * qk + m) == b).all(dim=1)
        d[idx[ok]] = dk[ok]
        q[idx[ok]] = qk[ok].to(torch.uint8)
        todo[idx[ok]] = False
    if bool(todo.any()):
        return None
    n, kdim = weight.shape
    q = q.view(-1, 2, 16)
    qs = (q[:, 0] | (q[:, 1] << 4)).reshape(n, kdim // 2).contiguous()
    dm = torch.cat((d, lo), dim=1).reshape(n, kdim // BLOCK, 2).contiguous()
    return qs, dm


def find_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(qs [N, K] int8, d [N, K/32] float32) that rebuild `weight` exactly, or None."""
    blocks = _blocks(weight)
    if blocks is None:
        return None
    amax = blocks.abs().amax(dim=1, keepdim=True)
    d = torch.zeros_like(amax)
    q = torch.zeros_like(blocks, dtype=torch.int8)
    todo = (amax > 0).squeeze(1)
    for k in range(127, 0, -1):
        if not bool(todo.any()):
            break
        if k < 100:  # a block whose largest |q| is this small was not written by a Q8_0 quantizer
            return None
        idx = todo.nonzero().squeeze(1)
        b = blocks[idx]
        dk = (amax[idx] / k).half().float()
        qk = torch.round(b / dk.clamp(min=torch.finfo(torch.float16).tiny)).clamp(-127, 127)
        ok = ((dk * qk) == b).all(dim=1)
        d[idx[ok]] = dk[ok]
        q[idx[ok]] = qk[ok].to(torch.int8)
        todo[idx[ok]] = False
    if bool(todo.any()):
        return None
    n, kdim = weight.shape
    return q.reshape(n, kdim).contiguous(), d.reshape(n, kdim // BLOCK).contiguous()


def dequantize_blocks(blocks) -> torch.Tensor:
    """The float32 weights [..., K] that ("q4_1", (qs, dm)) or ("q8_0", (qs, d)) hold (leading dims kept)."""
    fmt, (qs, scales) = blocks
    if fmt == "q4_1":
        # byte j of a block holds q[j] (low nibble) and q[j + 16] (high nibble)
        b = qs.reshape(*qs.shape[:-1], -1, BLOCK // 2)
        q = torch.cat((b & 15, b >> 4), dim=-1).float()
        w = q * scales[..., 0:1] + scales[..., 1:2]
    else:
        q = qs.reshape(*qs.shape[:-1], -1, BLOCK).float()
        w = q * scales[..., None]
    return w.reshape(*qs.shape[:-1], -1)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qs [N, K] int8, d [N, K/32] float32): weight-only int8, one scale per block of 32 inputs (lossy)."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / 127
    q = torch.round(blocks / d.clamp(min=1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), d.contiguous()
