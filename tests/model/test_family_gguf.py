"""Each family's tiny model written as llama.cpp's converter writes it (tests/model/gguf_writer.py) loads from
the GGUF file, as blocks and dequantized, and equals transformers' logits of the same model in float32.

What the file cannot say is set in the HF config the way llama.cpp would run the file: Gemma's
query_pre_attn_scalar is head_dim (llama.cpp's rule for shapes other than 27B), Gemma 3 has llama.cpp's
pattern of five sliding layers and one global, Qwen3 has no window.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve.attention.backend import get_attention_backend
from pagedserve.model.loader import load_model
from pagedserve.model.registry import get_model_class, resolve_architecture
from tests.model.gguf_writer import BPE_TOKENS, SPM_TOKENS, write_gguf
from tests.model.test_families import TINY, family_config
from tests.paged_metadata import run_paged_schedule
from tests.tiny_models import random_hf_model

_CONFIGS = {
    "qwen3": lambda: family_config("qwen3", vocab_size=len(BPE_TOKENS), use_sliding_window=False,
                                   sliding_window=None, layer_types=["full_attention"] * 2),
    "gemma2": lambda: family_config("gemma2", vocab_size=len(SPM_TOKENS), query_pre_attn_scalar=16),
    "gemma3": lambda: _gemma3_six_layers(),
    "phi3": lambda: family_config("phi3", vocab_size=len(SPM_TOKENS)),
    # Qwen2.5's q/k/v biases; Llama 3.x rope scaling (written as the rope_freqs tensor), its q/k rows permuted.
    "qwen2": lambda: transformers.Qwen2Config(**TINY, num_hidden_layers=2, vocab_size=len(BPE_TOKENS),
                                              tie_word_embeddings=True),
    "llama": lambda: transformers.LlamaConfig(
        **TINY, num_hidden_layers=2, vocab_size=len(SPM_TOKENS), tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64)),
}


def _gemma3_six_layers():
    config = family_config("gemma3", vocab_size=len(SPM_TOKENS), query_pre_attn_scalar=16)
    config.num_hidden_layers, config.sliding_window_pattern = 6, 6
    config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    return config


def _logit_diff(loaded, hf_model, ids: list[list[int]], chunks: list[list[int]]) -> float:
    got = run_paged_schedule(loaded.model, ids, chunks, block_size=16)
    with torch.no_grad():
        return max((g - hf_model(torch.tensor([t])).logits[0]).abs().max().item() for t, g in zip(ids, got))


# Dequantized ("none"): the Gemma norms' 1 + w mark in the cache's metadata, Phi-3's fused tensors split.
@pytest.mark.parametrize("arch,quantization", [("qwen3", "gguf"), ("gemma2", "gguf"), ("gemma3", "gguf"),
                                               ("phi3", "gguf"), ("gemma2", "none"), ("phi3", "none"),
                                               ("qwen2", "gguf"), ("llama", "gguf")])
def test_family_gguf_matches_transformers(arch: str, quantization: str, model_cache) -> None:
    config = _CONFIGS[arch]()
    hf_model = random_hf_model(config)
    path = str(model_cache / f"tiny-{arch}.gguf")
    write_gguf(path, arch, hf_model, config)
    loaded = load_model(path, quantization=quantization)
    assert loaded.quantization == quantization
    if arch == "qwen3":
        assert loaded.hf_config.head_dim == 32 and loaded.model.head_dim == 32  # not hidden / heads = 16
    if arch.startswith("qwen"):
        assert loaded.tokenizer.encode(" t", add_special_tokens=False) == [256]  # the one merge
    else:
        assert loaded.tokenizer.convert_tokens_to_ids("\u2581t") == len(SPM_TOKENS) - 1
    assert loaded.model.family == type(loaded.model.family)(**{  # every switch as from the HF config
        f: getattr(_family_of(config), f) for f in loaded.model.family.__slots__})
    reference = get_model_class(resolve_architecture(config))(config, get_attention_backend("reference"),
                                                              dtype=torch.float32)
    for ours, want in zip(loaded.model.model.layers, reference.model.layers):  # rope bases, scaling, longrope
        ours, want = ours.self_attn.rotary_emb, want.self_attn.rotary_emb
        # Llama 3's frequencies come back as default / (default / llama3): equal to float32 rounding.
        torch.testing.assert_close(ours._table(), want._table(), rtol=0, atol=0 if arch != "llama" else 1e-5)
        assert ours.attention_scaling == want.attention_scaling
    vocab = config.vocab_size
    gen = torch.Generator().manual_seed(4)
    ids = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (30, 21)]
    diff = _logit_diff(loaded, hf_model, ids, [[13, 14, 1, 1, 1], [16, 2, 1, 1, 1]])
    assert diff < 1e-4, f"{arch} ({quantization}): max abs logit diff {diff}"


def _family_of(config):
    from pagedserve.model.family import decoder_family

    return decoder_family(config)


def test_byte_level_vocab_under_gemma3_reads_as_the_file_states(model_cache) -> None:
    # A Gemma 3 file whose vocabulary is byte-level BPE (tokenizer.ggml.model "gpt2"; build_models.py's gemma-3-1b
    # carries SmolLM2's): the tokenizer the file states, as a byte-level BPE tokenizer of the same vocabulary and
    # merge reads these strings, not one rebuilt as Gemma's sentencepiece pipeline.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    config = _gemma3_six_layers()
    config.vocab_size = len(BPE_TOKENS)
    path = str(model_cache / "tiny-gemma3-bpe.gguf")
    write_gguf(path, "gemma3", random_hf_model(config), config, vocab="bpe")
    loaded = load_model(path, quantization="gguf")
    reference = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(BPE_TOKENS)}, merges=[("\u0120", "t")]))
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    reference.decoder = decoders.ByteLevel()
    for text in ["a t", " t t", "tt  t\n\n  t", "h\u00e9llo w\u00f6rld 12345", "def f(x):\n    return x"]:
        ids = loaded.tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text).ids, text
        assert loaded.tokenizer.decode(ids) == text
