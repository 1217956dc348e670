"""Rotary position embedding for flattened tokens, indexed by each token's absolute position.

Inverse frequencies come from transformers' ROPE_INIT_FUNCTIONS so scaled variants (linear, llama3, yarn)
match the checkpoints' reference implementation exactly. Rotation is the "rotate half" (GPT-NeoX) layout
that HF Llama weights use; GGUF q/k rows are un-permuted into that layout by the loader.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve import kernels
from pagedserve.model.hf_config import as_transformers_config

# "dynamic" (NTK) only rescales once a sequence outgrows max_position_embeddings, and the loader caps
# max_model_len there, so its frequencies at that length (== default) are exact. "longrope" switches
# frequency sets with the current sequence length, which one batch of mixed lengths cannot share: refused.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters(hf_config) -> dict:
    # transformers >= 5 keeps everything in config.rope_parameters; older configs used rope_theta + rope_scaling.
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def compute_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](as_transformers_config(hf_config), None)
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = compute_inv_freq(hf_config, head_dim)
        if inv_freq.numel() * 2 != head_dim:
            raise ValueError(f"rotary dim {inv_freq.numel() * 2} != head_dim {head_dim}")
        # Not persistent: derived from the config, never read from a checkpoint.
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.max_positions = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        # [max_positions, head_dim] = [cos | sin] of each position's angles, built on first kernel use.
        # The model shares one instance across its layers, so there is one table per model.
        self._cos_sin: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; query [T, Hq, D]; key [T, Hkv, D]. Angles in float32 as in the reference model,
        # then cast to the activations' dtype.
        ops = kernels.ops_for(query, kernels.LAYER_DTYPES)
        if ops is not None and self.max_positions and key.dtype == query.dtype:
            # In place: q and k are this layer's fresh projections, never shared.
            ops.rotary_embedding_(query, key, positions, self._table())
            return query, key
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(query.dtype)[:, None, :]
        sin = (emb.sin() * self.attention_scaling).to(query.dtype)[:, None, :]
        return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin

    def _table(self) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != self.inv_freq.device:
            # Same float32 angles as forward's torch path (position * inv_freq), so the same values.
            freqs = torch.arange(self.max_positions, device=self.inv_freq.device).float()[:, None] \
                * self.inv_freq[None, :]
            self._cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_scaling
        return self._cos_sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
