"""The attention backend protocol: the only place the model touches the paged KV cache.

A backend's forward does two things, in this order:
  1. writes this step's key/value rows into kv_cache at meta.slot_mapping (so a token sees its own K/V);
  2. lets each sequence's new tokens attend causally to that sequence's whole cached context, read through
     its block table.
Backends must agree with the reference backend (tests/attention compares them against dense attention).
"""
from __future__ import annotations

from typing import Protocol

import torch

from pagedserve.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # query [T, Hq, D], key/value [T, Hkv, D] with Hq % Hkv == 0 (GQA),
        # kv_cache: one layer's [2, num_blocks, block_size, Hkv, D]; returns [T, Hq, D].
        ...

    def with_window(self, sliding_window: int | None, logit_softcap: float | None) -> AttentionBackend:
        # The same backend for layers with a sliding window (keys p - W + 1 .. p) and/or Gemma 2's score cap.
        ...


BACKENDS = ("auto", "reference", "cpu")


def get_attention_backend(name: str = "reference", device: torch.device | str = "cpu") -> AttentionBackend:
    # Imported lazily so adding a backend with optional dependencies never breaks the others.
    # "auto": the compiled CPU kernel on CPU when it builds, else the reference (CUDA, no compiler).
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {list(BACKENDS)}")
    if name in ("auto", "cpu"):
        from pagedserve import kernels

        ops = kernels.load() if torch.device(device).type == "cpu" else None
        if ops is not None:
            from pagedserve.attention.cpu_paged import CpuPagedAttentionBackend

            return CpuPagedAttentionBackend(ops)
        if name == "cpu":
            raise ValueError("attention backend 'cpu' needs the compiled kernels on a CPU device; "
                             "see pagedserve.kernels (or use 'auto' / 'reference')")
    from pagedserve.attention.reference import ReferenceAttentionBackend

    return ReferenceAttentionBackend()
