"""A model's KV geometry on one device or tensor-parallel rank, derived from its config here and nowhere else.

Torch-free: the engine core sizes the pools with it, `pagedserve plan` reports it, and the worker allocates
through it (worker/kv_cache.py). Per layer the cache is [2, num_blocks, block_size, num_kv_heads, row]: row =
head_dim elements, plus a float32 scale for the 8-bit kinds (kv_dtypes.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve import kv_dtypes


def head_dim_of(hf_config) -> int:
    # Some families (Qwen3, Gemma) give head_dim; the others imply hidden_size / num_attention_heads.
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads_of(hf_config) -> int:
    # Configs without num_key_value_heads have one KV head per attention head (no grouped queries).
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # this rank's share of the model's KV heads
    head_dim: int
    block_size: int
    kv_dtype: str      # a kv_dtypes name ("float32", "bfloat16", "int8", ...)

    @property
    def bytes_per_token(self) -> int:
        return kv_dtypes.bytes_per_token(self.kv_dtype, self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token


def kv_cache_spec(hf_config, block_size: int, kv_dtype: str, tp_size: int = 1) -> KVCacheSpec:
    # Each tensor-parallel rank holds its num_kv_heads / tp_size heads of every block (the heads divide:
    # distributed/parallel_state.check_divisible).
    return KVCacheSpec(hf_config.num_hidden_layers, num_kv_heads_of(hf_config) // tp_size, head_dim_of(hf_config),
                       block_size, kv_dtype)
