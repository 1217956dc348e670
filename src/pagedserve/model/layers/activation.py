"""Gated MLP activations over a fused [gate | up] projection (one matmul instead of two): SiLU (Llama) and
GELU with the tanh approximation (Gemma's GeGLU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import kernels


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        ops = kernels.ops_for(gate_up, kernels.LAYER_DTYPES)
        if ops is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
            return ops.silu_and_mul(gate_up)  # one pass, no chunk/silu temporaries
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
