"""A tiny Qwen3 written as llama.cpp lays it out in a GGUF file loads and equals the same model's safetensors run.

The file is written with the gguf package (gguf-py, the writer llama.cpp's converter uses), with llama.cpp's
tensor names and metadata keys for qwen3, and a byte-level BPE vocabulary of 256 tokens and one merge.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedserve.model.loader import load_model
from tests.model.test_families import family_config
from tests.paged_metadata import run_paged_schedule
from tests.tiny_models import random_hf_model

# HF name inside model.layers.N -> llama.cpp's blk.N name (qwen3: no q/k row permutation).
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{suffix}"


# GPT-2's printable stand-ins for the 256 byte values, in byte order.
_BYTE_CHARS = [*range(33, 127), *range(161, 173), *range(174, 256)]
_BYTE_CHARS += [256 + i for i in range(256 - len(_BYTE_CHARS))]


def write_qwen3_gguf(path: str, hf_model, config) -> None:
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    tokens = [chr(c) for c in _BYTE_CHARS] + ["\u0120t"]  # GPT-2's byte alphabet, then "Ġt"
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["\u0120 t"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for name, tensor in hf_model.state_dict().items():
        w.add_tensor(_gguf_name(name), tensor.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("quantization", ["gguf", "none"])
def test_qwen3_gguf_matches_transformers(quantization: str, model_cache) -> None:
    # The GGUF format has no field for Qwen's sliding window: the tiny model attends to everything.
    config = family_config("qwen3", vocab_size=257, use_sliding_window=False, sliding_window=None,
                           layer_types=["full_attention"] * 2)
    hf_model = random_hf_model(config)
    path = str(model_cache / "tiny-qwen3.gguf")
    write_qwen3_gguf(path, hf_model, config)
    loaded = load_model(path, quantization=quantization)
    assert loaded.hf_config.head_dim == 32 and loaded.model.head_dim == 32  # not hidden / heads = 16
    assert loaded.tokenizer.encode(" t", add_special_tokens=False) == [256]  # the one merge
    ids = torch.randint(0, 257, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    got = run_paged_schedule(loaded.model, [ids], [[13, 14, 1, 1, 1]], block_size=16)[0]
    with torch.no_grad():
        diff = (got - hf_model(torch.tensor([ids])).logits[0]).abs().max().item()
    assert diff < 1e-4, f"max abs logit diff {diff}"
