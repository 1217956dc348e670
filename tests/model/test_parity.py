"""Tiny random Llama / Mistral / Qwen2 models: our paged forward equals transformers' full forward."""
from __future__ import annotations

import pytest
import torch
import transformers

from tests.paged_metadata import run_paged_schedule
from tests.tiny_models import random_hf_model
from pagedserve.attention.backend import get_attention_backend
from pagedserve.model.registry import get_model_class, resolve_architecture

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-6)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama-llama3-rope-bias": lambda: transformers.LlamaConfig(
        **TINY, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16)),
    "mistral-head-dim-32-yarn": lambda: transformers.MistralConfig(
        **TINY, head_dim=32, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=16.0,
                             original_max_position_embeddings=16)),
    "qwen2-tied-linear-rope": lambda: transformers.Qwen2Config(
        **TINY, tie_word_embeddings=True, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    # Windows shorter than the sequences (11 and 14 tokens), so masked keys change the logits.
    "mistral-sliding-window-5": lambda: transformers.MistralConfig(**TINY, sliding_window=5,
                                                                   tie_word_embeddings=False),
    # Layer 0 full attention, layer 1 windowed (Qwen2's max_window_layers).
    "qwen2-sliding-window-6": lambda: transformers.Qwen2Config(
        **TINY, sliding_window=6, use_sliding_window=True, max_window_layers=1, tie_word_embeddings=False),
}

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]

SCHEDULES = {
    # prompts of 7 and 10 tokens in one batch, then 4 decode steps
    "prefill+decode": [[7, 1, 1, 1, 1], [10, 1, 1, 1, 1]],
    # first prompt split in 2 chunks (second chunk runs next to the other's decode), then decode
    "chunked-prefill": [[6, 5, 1, 1], [10, 1, 1, 1]],
}


def make_pair(name: str, device: str = "cpu"):
    hf_config = CONFIGS[name]()
    hf_model = random_hf_model(hf_config, device=device)
    cls = get_model_class(resolve_architecture(hf_config))
    ours = cls(hf_config, get_attention_backend("reference"), device=device, dtype=torch.float32).eval()
    ours.load_weights(hf_model.state_dict().items())
    return hf_model, ours


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("device", DEVICES)
def test_logits_match_transformers(name: str, schedule: str, device: str) -> None:
    hf_model, ours = make_pair(name, device)
    chunks = SCHEDULES[schedule]
    gen = torch.Generator().manual_seed(1)
    token_ids = [torch.randint(0, 128, (sum(c),), generator=gen).tolist() for c in chunks]
    got = run_paged_schedule(ours, token_ids, chunks, block_size=4)
    with torch.no_grad():
        for ids, g in zip(token_ids, got):
            expected = hf_model(torch.tensor([ids], device=device)).logits[0]
            assert g.shape == expected.shape
            diff = (g - expected).abs().max().item()
            assert diff < 1e-4, f"{name}/{schedule}: max abs diff {diff}"


def test_load_weights_rejects_missing_and_unknown() -> None:
    hf_model, ours = make_pair("llama")
    state = dict(hf_model.state_dict())
    state.pop("model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match="missing"):
        ours.load_weights(state.items())
    with pytest.raises(ValueError, match="no matching parameter"):
        ours.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(96, 64))])
    with pytest.raises(ValueError, match="shape"):
        ours.load_weights([("model.norm.weight", torch.zeros(3))])


def test_registry_rejects_unsupported() -> None:
    with pytest.raises(ValueError, match="LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"):
        resolve_architecture(transformers.GPT2Config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="supported"):
        get_model_class("GPT2LMHeadModel")
    assert resolve_architecture(transformers.LlamaConfig()) == "LlamaForCausalLM"


def test_sliding_window_is_not_full_attention() -> None:
    # Guards the window tests above against a window that never takes effect: with the window removed
    # our logits must differ from transformers' windowed ones.
    hf_model, _ = make_pair("mistral-sliding-window-5")
    config = CONFIGS["mistral-sliding-window-5"]()
    config.sliding_window = None
    full = get_model_class(resolve_architecture(config))(config, get_attention_backend("reference"),
                                                          dtype=torch.float32).eval()
    full.load_weights(hf_model.state_dict().items())
    ids = torch.randint(0, 128, (14,), generator=torch.Generator().manual_seed(2)).tolist()
    got = run_paged_schedule(full, [ids], [[14]], block_size=4)[0]
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    assert (got[:5] - expected[:5]).abs().max().item() < 1e-4  # inside the window both agree
    assert (got[5:] - expected[5:]).abs().max().item() > 1e-3


def test_sliding_windows_per_layer() -> None:
    from pagedserve.model.family import sliding_windows

    assert sliding_windows(CONFIGS["mistral-sliding-window-5"]()) == [5, 5]
    assert sliding_windows(CONFIGS["qwen2-sliding-window-6"]()) == [None, 6]
    assert sliding_windows(CONFIGS["qwen2-tied-linear-rope"]()) == [None, None]
    assert sliding_windows(CONFIGS["llama"]()) == [None, None]
