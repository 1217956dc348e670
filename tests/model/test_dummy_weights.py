"""--load-format dummy: a config directory (no weights) loads as a random model of its shape."""
from __future__ import annotations

import argparse

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.model.dummy_weights import DUMMY_WEIGHT_BOUND
from pagedserve.model.loader import load_model, resolve_model_dir
from tests.paged_metadata import run_paged_schedule


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> str:
    # config.json and the embedded model's tokenizer files, and no weights at all.
    d = tmp_path_factory.mktemp("dummy") / "tiny-llama-config"
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_dir(None, weights=False)[0])
    transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=128,
                             tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                             architectures=["LlamaForCausalLM"]).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return str(d)


def _logits(loaded) -> torch.Tensor:
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    return run_paged_schedule(loaded.model, [ids], [[5, len(ids) - 5]], block_size=4)[0]


def test_dummy_weights_are_small_seeded_draws(config_dir) -> None:
    first = load_model(config_dir, dtype=torch.float32, load_format="dummy")
    second = load_model(config_dir, dtype=torch.float32, load_format="dummy")
    params = dict(first.model.named_parameters())
    assert params.keys() == dict(second.model.named_parameters()).keys()
    for name, p in second.model.named_parameters():
        assert torch.equal(params[name], p), name
        # Every parameter drawn (norm weights were ones, the others uninitialised), uniformly in the bound.
        assert p.abs().max() <= DUMMY_WEIGHT_BOUND, name
        assert p.numel() < 100 or abs(p.std().item() - DUMMY_WEIGHT_BOUND / 3 ** 0.5) < 0.2 * DUMMY_WEIGHT_BOUND, name
    logits = _logits(first)
    assert torch.isfinite(logits).all() and logits.std() > 0
    assert torch.equal(logits, _logits(second))


def test_dummy_int8_runs_q8_0_blocks(config_dir) -> None:
    dense = _logits(load_model(config_dir, dtype=torch.float32, load_format="dummy"))
    int8 = load_model(config_dir, dtype=torch.float32, quantization="int8", load_format="dummy")
    assert int8.quantization == "int8"
    quantized = _logits(int8)
    # Q8_0 moves each weight by at most half a step of 1/127 of its block's largest value: logits move a little.
    assert not torch.equal(quantized, dense)
    assert (quantized - dense).abs().max() < 0.05 * dense.abs().max()


def test_llm_generates_from_a_config_directory(config_dir) -> None:
    llm = LLM(config_dir, load_format="dummy", num_gpu_blocks_override=32, max_model_len=64)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first, second = (llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0] for _ in range(2))
    assert len(first.token_ids) == 6 and first.token_ids == second.token_ids


def test_dummy_on_a_gguf_file_takes_its_shape() -> None:
    loaded = load_model(None, dtype=torch.float32, load_format="dummy")  # the embedded SmolLM2's config
    embed = loaded.model.model.embed_tokens.weight
    assert embed.shape == (loaded.hf_config.vocab_size, loaded.hf_config.hidden_size)
    assert embed.abs().max() <= DUMMY_WEIGHT_BOUND and loaded.quantization == "none"


def test_without_weights_the_error_names_dummy(tmp_path) -> None:
    transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, intermediate_size=96,
                             num_hidden_layers=1, vocab_size=128).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no \\*.safetensors weights .*--load-format dummy"):
        load_model(str(tmp_path))


def test_invalid_load_format_lists_the_valid_ones(config_dir) -> None:
    with pytest.raises(ValueError, match="--load-format 'safetensorz' is not supported; valid values: auto, dummy"):
        EngineArgs(model=config_dir, load_format="safetensorz").create_engine_config()
    with pytest.raises(ValueError, match="valid values: auto, dummy"):
        load_model(config_dir, load_format="pt")
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(exit_on_error=False))
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'bogus'.*'auto', 'dummy'"):
        parser.parse_args(["--load-format", "bogus"])
    assert EngineArgs.from_cli_args(parser.parse_args(["--load-format", "dummy"])).create_engine_config() \
        .model.load_format == "dummy"
