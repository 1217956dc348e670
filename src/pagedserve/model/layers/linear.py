"""Linear layers whose float32 CPU matmuls run on oneDNN with a weight prepacked once after loading.

On this class of CPU (AVX-512) torch's default fp32 linear (MKL sgemm on a [out, in] weight) reaches
about 110-160 GFLOP/s on two cores; oneDNN with a blocked, prepacked weight reaches about 170-210 at every
batch size from 16 tokens up (measurements in benchmarks/README.md, "Profile"). The packed copy is an
opaque mkldnn tensor kept beside the ordinary parameter, which stays the source of truth: load_weights
writes the parameter and then calls pack_linear_weights again. CUDA, other dtypes and torch builds
without oneDNN keep F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None

    def pack(self) -> None:
        self.packed_weight = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.packed_weight, self.bias)


def pack_linear_weights(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, Linear):
            m.pack()
