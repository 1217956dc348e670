"""What sets one decoder family apart from Llama, read once from the config as a few switches.

Every family runs the same modules (model/llama.py, model/decoder_layer.py); these switches say which parts
of them are on:

    Llama, Mistral   the plain pre-norm layer
    Qwen2            q/k/v biases
    Qwen3            per-head q/k RMSNorm before rope, head_dim from the config
    Phi-3 / Phi-4    fused qkv_proj / gate_up_proj in the checkpoint (split on load), longrope, partial rotary
    Gemma 2          embedding * sqrt(hidden), RMSNorm weights 1 + w, GeGLU (tanh gelu), norms before and after
                     attention and MLP ("sandwich"), attention and final logit soft-capping,
                     scale query_pre_attn_scalar ** -0.5, sliding window on alternate layers
    Gemma 3 text     Gemma 2 without soft-capping by default, plus q/k norm and the local layers' own rope base

Gemma's norms multiply by (1 + w): the loader stores 1 + w in the norm's weight (as llama.cpp's converter
does in a GGUF file), so every norm runs the one RMSNorm kernel.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from pagedserve.kv_spec import head_dim_of, num_kv_heads_of
from pagedserve.model.layers.rotary import rotary_dim

# The model types whose switches the config does not spell out.
_GEMMA = ("gemma2", "gemma3_text")
_QK_NORM = ("qwen3", "gemma3_text")
# Checkpoint tensors that some families store fused, and the per-part names the layers load (Phi-3).
FUSED_CHECKPOINT = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_python_tanh")


@dataclass(frozen=True, slots=True)
class DecoderFamily:
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sandwich_norms: bool  # Gemma: post-attention and pre/post-feedforward norms (HF names) around the branches
    norm_weight_offset: float  # added to checkpoint norm weights on load (Gemma's 1 + w)
    gelu_tanh: bool  # GeGLU with the tanh approximation instead of SiLU
    embed_scale: float | None
    attn_scale: float
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    layer_windows: tuple[int | None, ...]  # per layer: the attention window, None for full attention
    layer_rope: tuple[str | None, ...]  # per layer: the rope_parameters entry (Gemma 3), None: the model's one
    partial_rotary: bool  # rope turns only the first rotary_dim of each head's dims (Phi-4-mini)

    @property
    def runs_llama_layers(self) -> bool:
        # The compiled decoder stack (layers/decoder_stack.py) implements only the plain Llama layer.
        return not (self.qk_norm or self.sandwich_norms or self.gelu_tanh or self.partial_rotary
                    or self.attn_logit_softcap is not None or len(set(self.layer_rope)) > 1)


def activation_name(hf_config) -> str:
    # Gemma configs name it hidden_activation (hidden_act may be None there).
    return getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None) or "silu"


def decoder_family(hf_config) -> DecoderFamily:
    model_type = getattr(hf_config, "model_type", None)
    gemma = model_type in _GEMMA
    act = activation_name(hf_config)
    if act != "silu" and act not in GELU_TANH:
        raise ValueError(f"unsupported hidden activation {act!r}; supported: "
                         f"{', '.join(map(repr, ('silu',) + GELU_TANH))}")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention is not supported (pagedserve serves causal decoders)")
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    head_dim = head_dim_of(hf_config)
    query_scalar = getattr(hf_config, "query_pre_attn_scalar", None) if gemma else None
    layer_types = getattr(hf_config, "layer_types", None)
    per_type_rope = isinstance(getattr(hf_config, "rope_parameters", None), dict) and layer_types is not None \
        and all(t in hf_config.rope_parameters for t in set(layer_types))
    return DecoderFamily(
        qkv_bias=model_type == "qwen2" or attention_bias, o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)), qk_norm=model_type in _QK_NORM,
        sandwich_norms=gemma, norm_weight_offset=1.0 if gemma else 0.0, gelu_tanh=act in GELU_TANH,
        embed_scale=hf_config.hidden_size ** 0.5 if gemma else None,
        attn_scale=(query_scalar if query_scalar else head_dim) ** -0.5,
        attn_logit_softcap=getattr(hf_config, "attn_logit_softcapping", None) if gemma else None,
        final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None) if gemma else None,
        layer_windows=tuple(sliding_windows(hf_config)),
        layer_rope=tuple(layer_types) if per_type_rope else (None,) * hf_config.num_hidden_layers,
        partial_rotary=rotary_dim(hf_config, head_dim) != head_dim)


def sliding_windows(hf_config) -> list[int | None]:
    # Per layer: the attention window, or None for full attention. transformers' layer_types names the
    # sliding layers (Qwen2/3: those from max_window_layers on, when use_sliding_window; Gemma: alternate
    # layers); configs without it (Mistral, Phi-3) window every layer when sliding_window is set.
    num_layers, window = hf_config.num_hidden_layers, getattr(hf_config, "sliding_window", None)
    if not window:
        return [None] * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return [int(window) if t == "sliding_attention" else None for t in layer_types]
    if not getattr(hf_config, "use_sliding_window", True):
        return [None] * num_layers
    return [int(window)] * num_layers


def split_fused_weights(weights: Iterable[tuple[str, object]], hf_config) -> Iterator[tuple[str, object]]:
    # A fused checkpoint tensor (Phi-3's qkv_proj, gate_up_proj) as the per-part tensors the other families
    # store, so loading, tensor-parallel slicing and the fused layers see one naming. Parts are row ranges;
    # lazy safetensors slices are read only there.
    head_dim = head_dim_of(hf_config)
    q_rows = hf_config.num_attention_heads * head_dim
    kv_rows = num_kv_heads_of(hf_config) * head_dim
    part_rows = {"qkv_proj": (q_rows, kv_rows, kv_rows),
                 "gate_up_proj": (hf_config.intermediate_size, hf_config.intermediate_size)}
    for name, weight in weights:
        parts = name.split(".")
        fused = parts[-2] if len(parts) >= 2 else None
        if fused not in FUSED_CHECKPOINT:
            yield name, weight
            continue
        num_rows = (weight.get_shape() if hasattr(weight, "get_shape") else weight.shape)[0]
        if num_rows != sum(part_rows[fused]):  # parts cut from a tensor of another shape would load silently
            raise ValueError(f"checkpoint tensor {name!r} has {num_rows} rows, expected {sum(part_rows[fused])} "
                             f"({' + '.join(map(str, part_rows[fused]))})")
        start = 0
        for part, rows in zip(FUSED_CHECKPOINT[fused], part_rows[fused]):
            yield ".".join(parts[:-2] + [part, parts[-1]]), weight[start:start + rows]
            start += rows
