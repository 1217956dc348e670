"""RMSNorm as Llama-family checkpoints expect it: statistics in float32, weight applied after casting back.

forward_residual fuses the residual add that precedes every norm in a pre-norm decoder (vLLM's
fused_add_rms_norm): residual += x, then x = norm(residual). On float32 CPU both run in one compiled
kernel, in place; elsewhere the same arithmetic in torch ops. bfloat16 runs in the same kernels (float32
inside, one rounding per output instead of torch's two).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve import kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = kernels.ops_for(x, kernels.LAYER_DTYPES)
        if ops is not None and x.dim() == 2 and self.weight.dtype == x.dtype:
            return ops.rms_norm(x, self.weight, self.eps)
        return self._forward_torch(x)

    def _forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(in_dtype)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Returns (norm(residual + x), residual + x). May overwrite x and residual: callers pass tensors
        # they own (layer outputs), never parameters or user inputs.
        ops = kernels.ops_for(x, kernels.LAYER_DTYPES)
        if (ops is not None and x.dim() == 2 and x.shape == residual.shape and residual.dtype == x.dtype
                and x.stride(1) == 1 and residual.stride(1) == 1 and self.weight.dtype == x.dtype):
            ops.fused_add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self._forward_torch(residual), residual
