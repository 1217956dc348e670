"""A tiny HF model written as a GGUF file the way llama.cpp's convert_hf_to_gguf.py writes its family.

Written with the gguf package (gguf-py, the writer the converter uses), with the converter's tensor names,
metadata keys and tensor edits per architecture:

    all      no output.weight when tied
    gemma2   norm weights + 1, softcaps and sliding_window, key/value_length; no rope
             base (llama.cpp's default 10000)
    gemma3   norm weights + 1, rope.freq_base (global layers, with rope.scaling linear) and rope.freq_base_swa,
             sliding_window, final_logit_softcapping only when set
    phi3     attn_qkv and ffn_up fused as in the checkpoint, rope.dimension_count, sliding_window (0: none),
             rope.scaling.original_context_length, rope_factors_long / rope_factors_short tensors, attn_factor
    qwen3    the plain names, key_length
    qwen2    the plain names (q/k/v biases too)
    llama    q and k rows permuted (LlamaModel.permute), rope.dimension_count, and for llama3 rope scaling the
             rope_freqs tensor (one divisor per frequency) instead of scaling keys

and a sentencepiece vocabulary (gemma, phi3, llama: tokenizer model "llama") or a byte-level BPE one (qwen, or any
architecture with vocab="bpe", as build_models.py's gemma-3-1b carries SmolLM2's): the 256 bytes and one merge,
so " t" is one token.
"""
from __future__ import annotations

import math

import gguf
import numpy as np

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}
_ARCH_LAYER = {"gemma2": _GEMMA, "gemma3": _GEMMA,
               "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
# GPT-2's printable stand-ins for the 256 byte values, in byte order.
_BYTE_CHARS = [*range(33, 127), *range(161, 173), *range(174, 256)]
_BYTE_CHARS += [256 + i for i in range(256 - len(_BYTE_CHARS))]
# The sentencepiece vocabulary: pad, eos, bos, unk, the 256 byte tokens, then three pieces.
SPM_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "t", "\u2581t"]
BPE_TOKENS = [chr(c) for c in _BYTE_CHARS] + ["\u0120t"]  # GPT-2's byte alphabet, then "Ġt"


def gguf_name(hf_name: str, arch: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_ARCH_LAYER.get(arch, {}).get(module) or _LAYER[module]}.{suffix}"


def write_gguf(path: str, arch: str, hf_model, config, vocab: str | None = None) -> None:
    # vocab: "bpe" or "spm" (default: the architecture's own, as above).
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    _METADATA[arch](w, config)
    _add_vocab(w, vocab or ("bpe" if arch in ("qwen2", "qwen3") else "spm"))
    state = hf_model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the converter writes no copy of a tied embedding
    for name, tensor in state.items():
        data = tensor.numpy().astype(np.float32)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + np.float32(1)  # the converter's norm shift: Gemma's RMSNorm scales by 1 + w
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        w.add_tensor(gguf_name(name, arch), data)
    if arch == "phi3":
        _add_rope_factors(w, config)
    if arch == "llama" and config.rope_parameters.get("rope_type") == "llama3":
        _add_rope_freqs(w, config)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gemma2(w, config) -> None:
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_attn_logit_softcapping(config.attn_logit_softcapping)
    w.add_final_logit_softcapping(config.final_logit_softcapping)
    w.add_sliding_window(config.sliding_window)


def _gemma3(w, config) -> None:
    full, local = config.rope_parameters["full_attention"], config.rope_parameters["sliding_attention"]
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base(full["rope_theta"])
    w.add_rope_freq_base_swa(local["rope_theta"])
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    if config.final_logit_softcapping:
        w.add_final_logit_softcapping(config.final_logit_softcapping)
    w.add_sliding_window(config.sliding_window)


def _phi3(w, config) -> None:
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(config.sliding_window or 0)


def _qwen3(w, config) -> None:
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])


def _qwen2(w, config) -> None:
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])


def _llama(w, config) -> None:
    w.add_vocab_size(config.vocab_size)
    w.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])


def _add_rope_freqs(w, config) -> None:
    # The converter's factors are the default frequencies over llama3's: 1, the factor, or the smoothed ratio.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim = config.hidden_size // config.num_attention_heads
    default = 1.0 / (config.rope_parameters["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim))
    scaled = ROPE_INIT_FUNCTIONS["llama3"](config, None)[0].double().numpy()
    w.add_tensor("rope_freqs.weight", (default / scaled).astype(np.float32))


_METADATA = {"gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3, "qwen3": _qwen3, "qwen2": _qwen2, "llama": _llama}


def _add_rope_factors(w, config) -> None:
    rope = config.rope_parameters
    original = rope["original_max_position_embeddings"]
    scale = config.max_position_embeddings / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _add_vocab(w, vocab: str) -> None:
    if vocab == "bpe":
        w.add_tokenizer_model("gpt2")
        w.add_token_list(BPE_TOKENS)
        w.add_token_types([1] * len(BPE_TOKENS))
        w.add_token_merges(["\u0120 t"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        return
    w.add_tokenizer_model("llama")
    w.add_token_list(SPM_TOKENS)
    w.add_token_scores([0.0] * 4 + [0.0] * 256 + [-1.0, -2.0, -0.5])
    w.add_token_types([3, 3, 3, 2] + [6] * 256 + [1, 1, 1])  # control, unknown, byte, normal
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
