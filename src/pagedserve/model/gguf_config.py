"""What a GGUF file says about its family beyond what transformers' GGUF config reader keeps.

transformers reads the shapes (layers, heads, hidden size, rope base) of a llama, gemma2, gemma3 or phi3 file but
drops the settings that make the family: soft-capping, which layers slide and by how much, the local layers'
rope base, the longrope factors. `complete_config` puts them back into the config dict from llama.cpp's own
keys (as its convert_hf_to_gguf.py writes them), and where the file has no key, from the value llama.cpp
assumes when it runs the same file (llama-model.cpp's load_hparams), so both engines run the same model:

    gemma2  attn/final_logit_softcapping (absent: 50 / 30), attention.sliding_window (absent: 4096),
            every other layer sliding (layers 0, 2, ...)
    gemma3  attention.sliding_window (absent or 0: no sliding layer), five sliding layers then one global,
            rope.freq_base for the global layers (with rope.scaling.type linear and its factor) and
            rope.freq_base_swa (absent: 10000) for the sliding ones, final_logit_softcapping if present
    both    query_pre_attn_scalar: hidden / heads for the 27B shapes (46 and 62 layers), else head_dim
            (llama.cpp has no key for it); attention.sliding_window_pattern overrides the layer pattern
    llama   the rope_freqs tensor (Llama 3.x rope scaling: per-frequency divisors) as rope_freq_factors
    phi3    rope.dimension_count (partial rotary), attention.sliding_window (0: none, Phi-4),
            rope.scaling.original_context_length and the rope_factors_long / rope_factors_short tensors
            (longrope), rope.scaling.attn_factor
"""
from __future__ import annotations

import math

import numpy as np

from pagedserve.model.gguf_file import GGUFFile

FAMILY_ARCHITECTURES = ("gemma2", "gemma3", "phi3")
# llama.cpp's layer counts of the 27B shapes, whose attention scale is (hidden / heads) ** -0.5.
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
# llama.cpp's set_swa_pattern(n) per architecture: in each run of n layers all but the last slide.
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}


def complete_config(config: dict, gguf: GGUFFile) -> dict:
    """config (transformers' reading of the file, as a dict) with the family's settings filled in."""
    arch = gguf.fields.get("general.architecture")
    if arch == "llama":
        return _llama_rope_freqs(config, gguf)
    if arch not in FAMILY_ARCHITECTURES:
        return config
    config = dict(config)

    def key(name: str, default=None):
        return gguf.fields.get(f"{arch}.{name}", default)

    num_layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    head_dim = int(key("attention.key_length") or hidden // heads)
    config["head_dim"] = head_dim
    if arch == "phi3":
        _phi3(config, gguf, key, head_dim)
        return config
    config["hidden_activation"] = "gelu_pytorch_tanh"
    config["query_pre_attn_scalar"] = hidden // heads if num_layers == _LAYERS_27B[arch] else head_dim
    window = int(key("attention.sliding_window", 4096 if arch == "gemma2" else 0))
    sliding = _sliding_layers(key("attention.sliding_window_pattern", _SWA_PATTERN[arch]), num_layers)
    if not window:
        sliding = [False] * num_layers
    config["sliding_window"] = window or None
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    config["final_logit_softcapping"] = key("final_logit_softcapping", 30.0 if arch == "gemma2" else None)
    if arch == "gemma2":
        config["attn_logit_softcapping"] = key("attn_logit_softcapping", 50.0)
        return config
    config["attn_logit_softcapping"] = None
    full = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 1_000_000.0))}
    if key("rope.scaling.type") == "linear" and key("rope.scaling.factor"):
        full.update(rope_type="linear", factor=float(key("rope.scaling.factor")))
    local = {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10_000.0))}
    config["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    for stale in ("rope_theta", "rope_scaling"):
        config.pop(stale, None)
    return config


def _sliding_layers(pattern, num_layers: int) -> list[bool]:
    if isinstance(pattern, list):  # one flag per layer
        if len(pattern) != num_layers:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        return [bool(p) for p in pattern]
    n = int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(num_layers)]


def _phi3(config: dict, gguf: GGUFFile, key, head_dim: int) -> None:
    rope_dim = int(key("rope.dimension_count", head_dim))
    window = key("attention.sliding_window", 0)
    config["sliding_window"] = int(window) or None
    rope: dict = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10_000.0))}
    if rope_dim != head_dim:
        rope["partial_rotary_factor"] = rope_dim / head_dim
    factors = {t.name: t for t in gguf.tensors if t.name.startswith("rope_factors_")}
    if factors:
        long_t, short_t = factors.get("rope_factors_long.weight"), factors.get("rope_factors_short.weight")
        original = key("rope.scaling.original_context_length")
        if long_t is None or short_t is None or original is None:
            raise ValueError(f"GGUF {gguf.path}: longrope needs rope_factors_long, rope_factors_short and "
                             "rope.scaling.original_context_length")
        rope.update(rope_type="longrope", long_factor=_floats(gguf, long_t), short_factor=_floats(gguf, short_t),
                    original_max_position_embeddings=int(original))
        config["original_max_position_embeddings"] = int(original)
        # transformers derives the same factor from the lengths; a file that says otherwise wins.
        scale = config["max_position_embeddings"] / int(original)
        derived = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1 else 1.0
        attn_factor = key("rope.scaling.attn_factor")
        if attn_factor is not None and abs(attn_factor - derived) > 1e-6:
            rope["attention_factor"] = float(attn_factor)
    config["rope_parameters"] = rope
    for stale in ("rope_theta", "rope_scaling", "partial_rotary_factor"):
        config.pop(stale, None)


def _llama_rope_freqs(config: dict, gguf: GGUFFile) -> dict:
    # Llama 3.x rope scaling: the converter writes no scaling keys but a rope_freqs tensor, one divisor per
    # frequency (llama.cpp divides each rotation angle by it); kept as such (layers/rotary.py: rope_freq_factors).
    tensor = next((t for t in gguf.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return config
    config = dict(config)
    theta = float(gguf.fields.get("llama.rope.freq_base", config.get("rope_theta", 10_000.0)))
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    config["rope_freq_factors"] = _floats(gguf, tensor)  # beside rope_parameters: transformers warns on its keys
    for stale in ("rope_theta", "rope_scaling"):
        config.pop(stale, None)
    return config


def _floats(gguf: GGUFFile, t) -> list[float]:
    from gguf import GGMLQuantizationType

    if t.qtype != GGMLQuantizationType.F32:
        raise ValueError(f"GGUF {gguf.path}: {t.name} is {GGMLQuantizationType(t.qtype).name}, expected F32")
    return np.frombuffer(gguf.read(t).tobytes(), dtype=np.float32).astype(float).tolist()
