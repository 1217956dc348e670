from __future__ import annotations

import pytest
import transformers

from tests.tiny_models import random_hf_model, save_hf_dir

# Heads, KV heads and MLP columns divide by 2; the vocabulary (the tokenizer's + 1) does not, so the last
# rank's vocab slice is padded. Biases everywhere and an untied LM head: every sharding rule is exercised.
TINY_TP = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-6, attention_bias=True, mlp_bias=True,
               tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tokenizer():
    from pagedserve.model.loader import resolve_model_dir

    return transformers.AutoTokenizer.from_pretrained(resolve_model_dir(None)[0])


def make_tiny_dir(tokenizer, path, max_position_embeddings: int) -> str:
    config = transformers.LlamaConfig(**TINY_TP, vocab_size=len(tokenizer) + 1,
                                      max_position_embeddings=max_position_embeddings)
    return save_hf_dir(random_hf_model(config, scale=0.2), tokenizer, path)


@pytest.fixture(scope="session")
def tiny_tp_dir(tokenizer, tmp_path_factory) -> str:
    return make_tiny_dir(tokenizer, tmp_path_factory.mktemp("tiny-tp") / "tiny-llama", 256)
