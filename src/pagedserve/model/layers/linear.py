"""Linear layers: one weight format for quantized weights (GGUF blocks), dense weights otherwise.

- Quantized (`exact_blocks`, the only copy of the weight): every batch size goes through the GGUF block
  dispatcher, layers/gguf_quant.py (a GGUF file's own blocks, or the Q8_0 blocks of --quantization int8).
- Dense float32 on CPU: oneDNN with a blocked weight prepacked once after the weights load (pack()). On
  AVX-512 CPUs torch's default fp32 linear (MKL sgemm on the [out, in] weight) reaches about 110-160 GFLOP/s
  on two cores, oneDNN about 170-210 from 16 tokens up.
- CUDA, other dtypes and builds without oneDNN or the compiled kernels keep F.linear.

The dense parameter stays the source of truth: load_weights writes it, then packs again. Measurements:
benchmarks/HISTORY.md, "Profile".

Batch-invariant mode (`batch_invariant`, set by the model's set_batch_invariant): GGUF blocks take one
row-independent kernel at every row count (layers/gguf_quant.py); dense weights go through fixed blocks of
INVARIANT_ROWS rows (invariant_linear).
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import kernels
from pagedserve.model.layers.gguf_quant import gguf_dequantize, gguf_linear

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


# Dense weights in batch-invariant mode: torch's GEMM (oneDNN, MKL) blocks K by the shape, so a row's sums
# change with the number of rows beside it (measured here: a 2048 x 8192 weight, fp32 and bf16, row 0 alone
# differs from row 0 among 2 or more). Every call instead multiplies blocks of exactly INVARIANT_ROWS rows (the
# last zero-padded): one shape, one blocking, and inside a block a row's sums depend neither on its neighbours
# nor on its position (tests/model/test_batch_invariant.py checks it on this machine's torch).
INVARIANT_ROWS = 16


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dim() != 2:
        return invariant_linear(x.reshape(-1, x.shape[-1]), weight, packed, bias).reshape(*x.shape[:-1], -1)
    m = x.shape[0]
    if m % INVARIANT_ROWS:
        x = torch.cat([x, x.new_zeros(INVARIANT_ROWS - m % INVARIANT_ROWS, x.shape[1])])
    return torch.cat([packed_linear(c, weight, packed, bias) for c in x.split(INVARIANT_ROWS)])[:m]


def dense_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                 bias: torch.Tensor | None = None, invariant: bool = False) -> torch.Tensor:
    return invariant_linear(x, weight, packed, bias) if invariant else packed_linear(x, weight, packed, bias)


# Activation dtypes GGUF block weights take (layers/gguf_quant.py).
GGUF_DTYPES = (torch.float32, torch.bfloat16)


def quant_linear(x: torch.Tensor, blocks, bias: torch.Tensor | None = None,
                 invariant: bool = False) -> torch.Tensor | None:
    # y = x W^T through the layer's GGUF blocks (every batch size), or None when this call cannot use them
    # (no blocks, another device or dtype, no compiled kernels): then the caller's dense path runs.
    if blocks is None or x.dim() != 2 or kernels.ops_for(x, GGUF_DTYPES) is None:
        return None
    return gguf_linear(x, blocks[1], bias, invariant)


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None
    # ("gguf", GGUFWeight) when the weight is held only as GGUF blocks (then self.weight is None): a GGUF
    # file's tensors as they lie in the file, or --quantization int8's Q8_0 blocks (model/weight_quant.py).
    exact_blocks = None
    batch_invariant = False  # each output row independent of the other rows (module doc)

    def reset_parameters(self) -> None:
        # Weights always come from load_weights, so nn.Linear's random init would only cost load time; and
        # nn.utils.skip_init (init on the meta device) imports torch._dynamo and triton: ~90 MB resident.
        pass

    def pack(self) -> None:
        if self.weight is None:  # blocks only: nothing to pack
            return
        self.packed_weight = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = quant_linear(x, self.exact_blocks, self.bias, self.batch_invariant)
        if y is not None:
            return y
        if self.weight is None:  # blocks only, and no kernel for this call (another device): a transient copy
            return dense_linear(x, gguf_dequantize(self.exact_blocks[1]).to(x), None, self.bias, self.batch_invariant)
        return dense_linear(x, self.weight, self.packed_weight, self.bias, self.batch_invariant)


def pack_linear_weights(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, Linear):
            m.pack()
