"""Qwen3, Gemma 2, Gemma 3 text and Phi-3: tiny random models equal transformers' logits and greedy tokens.

Each config turns on what sets its family apart (model/family.py), with windows of 8-12 tokens under
prompts of 30-40, so sliding layers see less than the whole sequence.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.attention.backend import get_attention_backend
from pagedserve.model.family import decoder_family
from pagedserve.model.registry import get_model_class, resolve_architecture
from tests.paged_metadata import run_paged_schedule
from tests.tiny_models import random_hf_model, save_hf_dir

TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-6)
_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                 short_factor=[1.0, 1.3, 1.7, 2.2], long_factor=[1.5, 2.5, 4.0, 6.0],
                 original_max_position_embeddings=64)


def family_config(name: str, vocab_size: int = 128, **extra):
    configs = {
        # head_dim 32 with 4 heads of hidden 64; layer 1 windowed (max_window_layers).
        "qwen3": lambda: transformers.Qwen3Config(
            **TINY, num_hidden_layers=2, head_dim=32, sliding_window=8, use_sliding_window=True,
            max_window_layers=1, tie_word_embeddings=False),
        # Soft caps small enough to bend these scores and logits; windowed layers 0 and 2.
        "gemma2": lambda: transformers.Gemma2Config(
            **TINY, num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
        # Local layers (0, 2) with rope base 100, global ones linear-scaled rope of base 10000.
        "gemma3": lambda: transformers.Gemma3TextConfig(
            **TINY, num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
            sliding_window_pattern=2, rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
        # Fused qkv / gate_up, longrope (its short factors: sequences within 64) on half of each head.
        "phi3": lambda: transformers.Phi3Config(
            **TINY, num_hidden_layers=2, sliding_window=12, rope_parameters=dict(_LONGROPE),
            original_max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0),
    }
    config = configs[name]()
    config.vocab_size = vocab_size
    for key, value in extra.items():
        setattr(config, key, value)
    return config


FAMILIES = ["qwen3", "gemma2", "gemma3", "phi3"]
# Two sequences of 40 and 30 tokens with block size 16: chunks that end mid-block, next to the other's
# decode steps, then decode.
SCHEDULE = [[13, 21, 1, 1, 1, 1, 1, 1], [24, 1, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("name", FAMILIES)
def test_paged_logits_match_transformers(name: str, numerics) -> None:
    config = family_config(name)
    hf_model = random_hf_model(config)
    ours = get_model_class(resolve_architecture(config))(config, get_attention_backend("auto"),
                                                         dtype=torch.float32).eval()
    ours.load_weights(hf_model.state_dict().items())
    gen = torch.Generator().manual_seed(1)
    token_ids = [torch.randint(0, 128, (sum(c),), generator=gen).tolist() for c in SCHEDULE]
    got = run_paged_schedule(ours, token_ids, SCHEDULE, block_size=16)
    with torch.no_grad():
        diff = max((g - hf_model(torch.tensor([ids])).logits[0]).abs().max().item() for ids, g in zip(token_ids, got))
    numerics[f"family_{name}_logits"] = diff
    assert diff < 1e-4, f"{name}: max abs logit diff {diff}"


def _hf_greedy(hf_model, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    # transformers' greedy tokens and, per step, the margin between its top two logits.
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                do_sample=False, output_logits=True, return_dict_in_generate=True)
    margins = [float(step[0].topk(2).values.diff().abs()) for step in out.logits]
    return out.sequences[0, len(prompt_ids):].tolist(), margins


def assert_same_greedy(got: list[int], want: list[int], margins: list[float], label: str) -> None:
    # Identical, except that from a near-tie of the reference (top-2 margin < 1e-3) on either may go its way.
    for step, (g, w) in enumerate(zip(got, want)):
        if g != w:
            assert margins[step] < 1e-3, f"{label}: token {step} is {g}, transformers {w} (margin {margins[step]})"
            return
    assert len(got) == len(want), label


def family_model_dir(name: str, embedded_model, path, seed: int = 0):
    # transformers' tiny model of the family and its directory, with the embedded model's tokenizer over the
    # first 512 of its ids (a small LM head keeps the tests quick).
    config = family_config(name, vocab_size=512, eos_token_id=embedded_model.eos_token_ids[0])
    hf_model = random_hf_model(config, scale=0.3, seed=seed)
    return hf_model, save_hf_dir(hf_model, embedded_model.tokenizer, path)


def random_prompts(seed: int, lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


def assert_matches_transformers(llm: LLM, hf_model, prompts: list[list[int]], max_tokens: int, label: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    for i, (out, ids) in enumerate(zip(outs, prompts)):
        want, margins = _hf_greedy(hf_model, ids, max_tokens)
        assert_same_greedy(list(out.outputs[0].token_ids), want, margins, f"{label} prompt {i}")


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_matches_transformers_with_prefix_caching(name: str, embedded_model, model_cache) -> None:
    # The whole engine (compiled kernel for full-attention layers, chunked prefill of 16 tokens, block size
    # 16): prompts past the window that share a 20-token prefix, run twice so the second round starts from
    # cached blocks.
    # The embedded model's tokenizer over the first 512 of its ids: a small LM head keeps the test quick.
    config = family_config(name, vocab_size=512, eos_token_id=embedded_model.eos_token_ids[0])
    hf_model = random_hf_model(config, scale=0.3)
    model_dir = save_hf_dir(hf_model, embedded_model.tokenizer, model_cache / name)
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 512, (20,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, 512, (n,), generator=gen).tolist() for n in (14, 9)]
    llm = LLM(model=model_dir, block_size=16, max_num_batched_tokens=16, enable_prefix_caching=True,
              kv_cache_memory_bytes=1 << 21)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    wants = [_hf_greedy(hf_model, ids, 16) for ids in prompts]
    for round_ in range(2):
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        for i, (out, (want, margins)) in enumerate(zip(outs, wants)):
            assert_same_greedy(list(out.outputs[0].token_ids), want, margins, f"{name} round {round_} prompt {i}")
    assert llm.llm_engine.core.kv.prefix_stats.num_hits >= 16  # the second round read the shared prefix


def test_model_types_resolve_and_bad_activation_is_refused() -> None:
    # GGUF-derived configs carry only model_type; each family resolves from it. None of these layers is the
    # plain Llama layer the compiled decoder stack runs (Phi-3 here for its partial rotary).
    want = {"qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
            "phi3": "Phi3ForCausalLM"}
    for name, arch in want.items():
        config = family_config(name)
        config.architectures = None
        assert resolve_architecture(config) == arch
        assert not decoder_family(config).runs_llama_layers, name
    config = family_config("gemma2")
    config.hidden_activation = "relu"
    with pytest.raises(ValueError, match="unsupported hidden activation 'relu'"):
        get_model_class("Gemma2ForCausalLM")(config, get_attention_backend("reference"), dtype=torch.float32)


def test_phi3_fused_tensors_shard_per_part_for_tensor_parallel() -> None:
    # Phi-3 stores [q | k | v] and [gate | up] fused; a rank must get its heads of each part, not a row
    # range of the fused tensor. Loaded as the loader does it: split by the full sizes, then sharded.
    from types import SimpleNamespace

    from pagedserve.model.family import split_fused_weights
    from pagedserve.model.layers.parallel import shard_config, shard_weights

    config = family_config("phi3")
    state = random_hf_model(config).state_dict()
    q_rows, kv_rows, inter = 64, 32, config.intermediate_size  # 4 x 16 query rows, 2 x 16 per kv part
    qkv, gate_up = state["model.layers.0.self_attn.qkv_proj.weight"], state["model.layers.0.mlp.gate_up_proj.weight"]
    for rank in range(2):
        tp = SimpleNamespace(rank=rank, world_size=2)
        local = get_model_class("Phi3ForCausalLM")(shard_config(config, 2), get_attention_backend("reference"),
                                                   dtype=torch.float32, tp=tp, vocab_size=config.vocab_size)
        local.load_weights(shard_weights(split_fused_weights(state.items(), config), tp, config.vocab_size))
        q, k, v = qkv.split([q_rows, kv_rows, kv_rows])
        want = torch.cat([part.chunk(2)[rank] for part in (q, k, v)])
        assert torch.equal(local.model.layers[0].self_attn.qkv_proj.weight, want)
        want = torch.cat([part.chunk(2)[rank] for part in gate_up.split([inter, inter])])
        assert torch.equal(local.model.layers[0].mlp.gate_up_proj.weight, want)
    with pytest.raises(ValueError, match="qkv_proj.weight. has 128 rows, expected 64"):  # whole, on a rank
        local.load_weights([("model.layers.0.self_attn.qkv_proj.weight", qkv)])


@pytest.mark.parametrize("name", FAMILIES)
def test_self_draft_speculation_matches_transformers(name: str, embedded_model, model_cache) -> None:
    # Draft-model speculation with the model as its own draft: the target verifies k + 1 tokens per step
    # through its windowed, capped or longrope layers, with chunked prefill and prefix caching on; greedy tokens
    # stay transformers' and the drafts are accepted.
    from tests.spec_decode.test_draft_model import draft_config

    hf_model, model_dir = family_model_dir(name, embedded_model, model_cache / name, seed=1)
    llm = LLM(model=model_dir, block_size=16, max_num_batched_tokens=16, enable_prefix_caching=True,
              kv_cache_memory_bytes=8 << 20, speculative_config=draft_config(model_dir, k=3))
    assert_matches_transformers(llm, hf_model, random_prompts(5, (27, 18)), 12, name)
    spec = llm.llm_engine.core.stats.spec
    assert spec.num_draft_tokens >= 2 * 3 and spec.acceptance_rate > 0.8, (spec.num_draft_tokens, spec.acceptance_rate)
