"""Rotary position embedding for flattened tokens, indexed by each token's absolute position.

Inverse frequencies come from transformers' ROPE_INIT_FUNCTIONS so scaled variants (linear, llama3, yarn,
longrope) match the checkpoints' reference implementation exactly. Rotation is the "rotate half" (GPT-NeoX)
layout that HF Llama weights use; GGUF q/k rows are un-permuted into that layout by the loader. A partial
rotary (partial_rotary_factor < 1, Phi-4-mini) turns the first rotary_dim dims of each head and passes the
rest through; Gemma 3 gives its sliding layers their own parameters (rope_parameters per layer type).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from pagedserve import kernels
from pagedserve.model.hf_config import as_transformers_config

# "dynamic" (NTK) only rescales once a sequence outgrows max_position_embeddings, and the loader caps
# max_model_len there, so its frequencies at that length (== default) are exact. "longrope" uses its short
# factors for a sequence of at most original_max_position_embeddings tokens and its long ones, at every
# position, for a longer one (transformers recomputes the cache when a sequence crosses; so does the
# scheduler). One batch mixes both, so its table has a row per (factor set, position):
#
#     rows [0, L)           short factors, positions 0 .. L-1        (L = original_max_position_embeddings)
#     rows [L, L + max)     long factors, positions 0 .. max-1
#
# and the model turns a token's position into its row: position, or L + position in a long sequence
# (model/llama.py, worker/model_runner.py).
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    # transformers >= 5 keeps everything in config.rope_parameters (per layer type for Gemma 3); older
    # configs used rope_theta + rope_scaling.
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type] or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def rotary_dim(hf_config, head_dim: int, layer_type: str | None = None) -> int:
    factor = rope_parameters(hf_config, layer_type).get("partial_rotary_factor",
                                                        getattr(hf_config, "partial_rotary_factor", 1.0))
    return int(head_dim * (factor or 1.0))


def compute_inv_freq(hf_config, head_dim: int, layer_type: str | None = None,
                     seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    # seq_len: the sequence length the frequencies are for (longrope's long factors past its original length).
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        dim = rotary_dim(hf_config, head_dim, layer_type)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq = 1.0 / (params["rope_theta"] ** exponents)
        freq_factors = getattr(hf_config, "rope_freq_factors", None)
        if freq_factors is not None:  # a Llama 3.x GGUF's rope_freqs tensor (model/gguf_config.py)
            factors = torch.tensor(freq_factors, dtype=torch.float32)
            if factors.numel() != inv_freq.numel():
                raise ValueError(f"rope freq_factors has {factors.numel()} entries, expected {inv_freq.numel()}")
            inv_freq = inv_freq / factors
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if seq_len is not None:
        kwargs["seq_len"] = seq_len
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](_rope_config(hf_config, head_dim), None, **kwargs)
    return inv_freq.float(), float(attention_scaling)


def _rope_config(hf_config, head_dim: int):
    # transformers' config for its rope functions. A tensor-parallel rank's config holds its share of the heads
    # with head_dim kept (layers/parallel.py: shard_config), but transformers' Phi-3 checks its longrope factors
    # against hidden_size / num_attention_heads: such a config gets back the head count that gives head_dim.
    heads, hidden = getattr(hf_config, "num_attention_heads", 0), getattr(hf_config, "hidden_size", 0)
    if heads and hidden // heads != head_dim and hidden % head_dim == 0 and (hidden // head_dim) % heads == 0:
        hf_config = copy.copy(hf_config)
        hf_config.num_attention_heads = hidden // head_dim
    return as_transformers_config(hf_config)


def longrope_switch_len(hf_config, layer_type: str | None = None) -> int | None:
    # The longest sequence the short longrope factors serve (the module doc), or None: no longrope.
    params = rope_parameters(hf_config, layer_type)
    if params["rope_type"] != "longrope":
        return None
    return int(params.get("original_max_position_embeddings")
               or getattr(hf_config, "original_max_position_embeddings", None) or hf_config.max_position_embeddings)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, device: torch.device | str | None = None,
                 layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = compute_inv_freq(hf_config, head_dim, layer_type)
        self.rotary_dim = inv_freq.numel() * 2
        if self.rotary_dim != rotary_dim(hf_config, head_dim, layer_type):
            raise ValueError(f"rotary dim {self.rotary_dim} != {rotary_dim(hf_config, head_dim, layer_type)} "
                             f"(head_dim {head_dim} and the config's partial_rotary_factor)")
        # Not persistent: derived from the config, never read from a checkpoint.
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.max_positions = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        # longrope: the first row of the long factors (the module doc); None for every other rope.
        self.long_rows_from = longrope_switch_len(hf_config, layer_type)
        if self.long_rows_from is not None:
            long_inv_freq = compute_inv_freq(hf_config, head_dim, layer_type, seq_len=self.long_rows_from + 1)[0]
            self.register_buffer("long_inv_freq", long_inv_freq.to(device), persistent=False)
        # [rows, rotary_dim] = [cos | sin] of each row's angles, built on first use. Layers with the same
        # rope parameters share one instance, so there is one table per parameter set.
        self._cos_sin: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; query [T, Hq, D]; key [T, Hkv, D]. Angles in float32 as in the reference model,
        # then cast to the activations' dtype.
        if self.rotary_dim != query.shape[-1]:  # partial: the kernel turns whole heads only
            rot = self.rotary_dim
            q_rot, k_rot = self._rotate(positions, query[..., :rot], key[..., :rot])
            return torch.cat((q_rot, query[..., rot:]), dim=-1), torch.cat((k_rot, key[..., rot:]), dim=-1)
        ops = kernels.ops_for(query, kernels.LAYER_DTYPES)
        if ops is not None and self.max_positions and key.dtype == query.dtype:
            # In place: q and k are this layer's fresh projections, never shared.
            ops.rotary_embedding_(query, key, positions, self._table())
            return query, key
        return self._rotate(positions, query, key)

    def _rotate(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.long_rows_from is not None:  # positions are table rows (the module doc)
            cos_sin = self._table()[positions]
            cos, sin = cos_sin.chunk(2, dim=-1)
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        else:
            freqs = positions[:, None].float() * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        cos, sin = cos.to(query.dtype)[:, None, :], sin.to(query.dtype)[:, None, :]
        return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin

    def _table(self) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != self.inv_freq.device:
            # Same float32 angles as _rotate's (position * inv_freq), so the same values.
            device = self.inv_freq.device
            if self.long_rows_from is None:
                freqs = torch.arange(self.max_positions, device=device).float()[:, None] * self.inv_freq[None, :]
            else:
                freqs = torch.cat((
                    torch.arange(self.long_rows_from, device=device).float()[:, None] * self.inv_freq[None, :],
                    torch.arange(self.max_positions, device=device).float()[:, None] * self.long_inv_freq[None, :]))
            self._cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_scaling
        return self._cos_sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
