"""`--kv-cache-dtype`: the element types the paged KV cache can hold, and what each costs per token.

Torch-free (pagedserve plan and the config use it); attention/kv_quant.py does the arithmetic.

    auto       the model's dtype
    float32    4 bytes per element
    bfloat16   2 bytes per element
    float16    2 bytes per element
    fp8_e4m3   1 byte per element + a float32 scale per (token, KV head, K or V)
    int8       1 byte per element + a float32 scale per (token, KV head, K or V)

The 8-bit kinds scale each head's vector of one token by its own absolute maximum (int8: 127 levels; fp8: to
e4m3's largest normal, 448), so a scale never has to cover other tokens' outliers and needs no calibration.
The scale's 4 bytes sit after the head's head_dim bytes in the same row, so a block still holds everything
about its tokens and block copies (swap, copy-on-write) move scales with the data.
"""
from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "int8")
ALIASES = {"fp8": "fp8_e4m3", "fp32": "float32", "bf16": "bfloat16"}
QUANTIZED = ("fp8_e4m3", "int8")
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "int8": 1}
SCALE_BYTES = 4


def canonical(name: str) -> str:
    # A --kv-cache-dtype value as KV_CACHE_DTYPES spells it; ValueError naming the flag otherwise.
    name = ALIASES.get(name.strip().lower(), name.strip().lower())
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not supported; valid values: {', '.join(KV_CACHE_DTYPES)}")
    return name


def resolve(cache_dtype: str, model_dtype: str) -> str:
    # The concrete KV dtype: `auto` follows the model.
    cache_dtype = canonical(cache_dtype)
    return model_dtype if cache_dtype == "auto" else cache_dtype


def row_bytes(kv_dtype: str, head_dim: int) -> int:
    # One token's key (or value) for one KV head.
    return head_dim * ELEMENT_BYTES[kv_dtype] + (SCALE_BYTES if kv_dtype in QUANTIZED else 0)


def bytes_per_token(kv_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    return 2 * num_layers * num_kv_heads * row_bytes(kv_dtype, head_dim)
