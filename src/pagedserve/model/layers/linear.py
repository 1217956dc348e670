"""Linear layers with two float32 CPU fast paths, both set up once after the weights load (pack()).

- Batched tokens (> QUANT_MAX_TOKENS rows): oneDNN with a blocked, prepacked weight. On this class of CPU
  (AVX-512) torch's default fp32 linear (MKL sgemm on the [out, in] weight) reaches about 110-160 GFLOP/s
  on two cores, oneDNN about 170-210 from 16 tokens up.
- A few tokens (decode at batch 1-8): bound by reading the weights, not by arithmetic. When the fp32
  weight is exactly GGUF block values (the embedded model is Q4_1 / Q8_0), a lossless block copy
  (layers/quant.py) is read instead: 0.75 bytes per weight instead of 4, the same fp32 products.

The fp32 parameter stays the source of truth: load_weights writes it, then packs again. CUDA, other
dtypes and builds without oneDNN or the compiled kernels keep F.linear; GGUF block weights
(layers/gguf_quant.py) also take bfloat16 activations. Measurements: benchmarks/README.md, "Profile".
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import kernels
from pagedserve.model.layers.gguf_quant import gguf_linear
from pagedserve.model.layers.quant import dequantize_blocks

logger = logging.getLogger(__name__)


def onednn_available() -> bool:
    return (kernels.fast_paths_enabled() and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and onednn_keeps_fp32())


# The packed path is taken only where oneDNN's float32 linear is float32: an environment can make oneDNN round
# inputs to bf16/f16 (ONEDNN_DEFAULT_FPMATH_MODE, torch's fp32_precision), which moves the embedded model's
# logits by 0.07-0.5 instead of ~1e-4. One probe per process, against float64.
FP32_PROBE_REL_ERROR = 1e-4


@functools.cache
def onednn_keeps_fp32() -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 576, generator=gen)
    w = torch.randn(384, 576, generator=gen)
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    exact = x.double() @ w.double().T
    error = ((got.double() - exact).abs().max() / exact.abs().max()).item()
    if error > FP32_PROBE_REL_ERROR:
        logger.warning("oneDNN's float32 linear rounds through a lower precision here (relative error %.1e; "
                       "ONEDNN_DEFAULT_FPMATH_MODE?): float32 linears use torch's F.linear instead", error)
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    # None when this weight cannot use the packed path (then callers use F.linear).
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not onednn_available():
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    if packed is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Activation dtypes GGUF block weights take (layers/gguf_quant.py); the other block copies take float32.
GGUF_DTYPES = (torch.float32, torch.bfloat16)
# Up to this many tokens the block copy wins; above it oneDNN's fp32 GEMM (compute-bound) is faster.
# Measured at 1 thread, whole model: 1 token 13.7 vs 45.7 ms, 8 tokens 45 vs 69, 16 tokens 98 vs 86.
QUANT_MAX_TOKENS = 8


def find_exact_blocks(weight: torch.Tensor, formats: tuple[str, ...] = ("q4_1", "q8_0")):
    # (fmt, tensors) for quant_linear when `weight` is exactly blocks of one of `formats`, else None. The
    # compiled search (one pass, ~0.2 s for the whole model; a plain fp32 weight fails at its first block)
    # does what layers/quant.py spells out in torch.
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    ops = kernels.load()
    if ops is None:
        return None
    for fmt in formats:
        qs, scales = (ops.find_q4_1 if fmt == "q4_1" else ops.find_q8_0)(weight.detach().contiguous())
        if qs.numel():
            return fmt, (qs, scales)
    return None


def quant_linear(x: torch.Tensor, blocks, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    # y = x W^T through the block copy, or None when this call should take the fp32 path. GGUF blocks
    # (layers/gguf_quant.py) are the only copy of their weight and take every batch size.
    if blocks is not None and blocks[0] == "gguf" and x.dim() == 2 and kernels.ops_for(x, GGUF_DTYPES) is not None:
        return gguf_linear(x, blocks[1], bias, QUANT_MAX_TOKENS)
    if blocks is None or x.shape[0] > QUANT_MAX_TOKENS or x.dim() != 2 or x.stride(1) != 1:
        return None
    ops = kernels.ops_for(x)
    if ops is None:
        return None
    fmt, (qs, scales) = blocks
    return (ops.gemm_q4_1 if fmt == "q4_1" else ops.gemm_q8_0)(x, qs, scales, bias)


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None
    # ("q4_1", (qs, dm)) / ("q8_0", (qs, d)) when the weight is exactly such blocks; ("gguf", GGUFWeight)
    # when the weight is only the blocks of its GGUF file (then self.weight is None).
    exact_blocks = None

    def reset_parameters(self) -> None:
        # Weights always come from load_weights, so nn.Linear's random init would only cost load time; and
        # nn.utils.skip_init (init on the meta device) imports torch._dynamo and triton: ~90 MB resident.
        pass

    def pack(self) -> None:
        if self.weight is None:  # blocks only: nothing to pack
            return
        self.packed_weight = pack_weight(self.weight)
        self.exact_blocks = find_exact_blocks(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = quant_linear(x, self.exact_blocks, self.bias)
        if y is not None:
            return y
        if self.weight is None:  # blocks only (--quantization, model/weight_quant.py): a transient fp32 copy
            return F.linear(x, dequantize_blocks(self.exact_blocks), self.bias)
        return packed_linear(x, self.weight, self.packed_weight, self.bias)


def pack_linear_weights(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, Linear):
            m.pack()
