"""Workload files and the capacity planner."""
from __future__ import annotations

import json

import pytest

from pagedserve.bench.dataset import DatasetError, WORDS, load_dataset, parse_range, random_requests
from pagedserve.model.hf_config import HFConfig
from pagedserve.plan import PlanModel, length_row, plan, read_model


def test_random_prompts_are_reproducible_with_a_shared_prefix():
    a = random_requests(8, (5, 9), (2, 3), shared_prefix_len=6, seed=1)
    assert a == random_requests(8, (5, 9), (2, 3), shared_prefix_len=6, seed=1)
    prefixes = {" ".join(r.prompt.split()[:6]) for r in a}
    assert len(prefixes) == 1
    for r in a:
        words = r.prompt.split()
        assert 11 <= len(words) <= 15 and r.prompt_len == len(words) and 2 <= r.output_len <= 3
        assert set(words) <= set(WORDS)


def test_each_sweep_point_gets_fresh_words_of_the_same_lengths():
    a, b = random_requests(4, (5, 9), (2, 3), 3, seed=1), random_requests(4, (5, 9), (2, 3), 3, seed=1, variant=1)
    assert [(r.prompt_len, r.output_len) for r in a] == [(r.prompt_len, r.output_len) for r in b]
    assert all(x.prompt.split()[:3] == y.prompt.split()[:3] for x, y in zip(a, b))  # the shared prefix stays
    assert all(x.prompt != y.prompt for x, y in zip(a, b))


def test_words_variant_keeps_lengths_and_the_shared_prefix():
    # A warm-up run with another --words-variant caches only the shared prefix for the measured run.
    import argparse

    from pagedserve.bench.cli import add_bench_args, workload

    parser = argparse.ArgumentParser()
    add_bench_args(parser, require_url=False)
    flags = ["--num-prompts", "6", "--input-len", "5-9", "--shared-prefix-len", "4"]
    default, warm = workload(parser.parse_args(flags)), workload(parser.parse_args(flags + ["--words-variant", "1"]))
    assert default == random_requests(6, (5, 9), (32, 128), shared_prefix_len=4)  # unchanged without the flag
    assert [(r.prompt_len, r.output_len) for r in default] == [(r.prompt_len, r.output_len) for r in warm]
    assert all(x.prompt.split()[:4] == y.prompt.split()[:4] and x.prompt != y.prompt for x, y in zip(default, warm))
    points = [workload(parser.parse_args(flags), point=i) for i in (1, 2)]  # sweep points differ from both
    assert len({tuple(r.prompt for r in w) for w in [default, warm, *points]}) == 4


def test_parse_range():
    assert parse_range("128") == (128, 128) and parse_range("64-256") == (64, 256)
    for bad in ("x", "9-3", "1-2-3"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_jsonl_dataset(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello there", "output_len": 7}\n\n{"prompt": "second"}\n')
    reqs = load_dataset(str(f), None, (1, 1), (4, 4))
    assert [(r.prompt, r.output_len) for r in reqs] == [("hello there", 7), ("second", 4)]


@pytest.mark.parametrize("text, match", [
    ('{"prompt": "ok"}\n{"prompt": "broken"\n', r"p.jsonl:2: not valid JSON"),
    ('{"text": "no prompt"}\n', r"p.jsonl:1: expected a non-empty string field 'prompt'"),
    ('{"prompt": "x", "output_len": -1}\n', r"p.jsonl:1: 'output_len' must be a positive integer"),
    ("\n\n", r"holds no prompts"),
])
def test_invalid_jsonl_names_the_line(tmp_path, text, match):
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    with pytest.raises(DatasetError, match=match):
        load_dataset(str(f), None, (1, 1), (4, 4))


def test_sharegpt_dataset(tmp_path):
    data = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x" * 40}]},
            {"conversations": [{"from": "human", "value": "alone"}]}]
    f = tmp_path / "s.json"
    f.write_text(json.dumps(data))
    reqs = load_dataset(str(f), None, (1, 1), (4, 4))
    assert [(r.prompt, r.output_len) for r in reqs] == [("hi", 10)]  # 40 chars ~ 10 tokens; 1-turn skipped
    f.write_text("{not json")
    with pytest.raises(DatasetError, match="not valid JSON"):
        load_dataset(str(f), None, (1, 1), (4, 4))
    with pytest.raises(DatasetError, match="cannot read dataset"):
        load_dataset(str(tmp_path / "missing.jsonl"), None, (1, 1), (4, 4))


def test_kv_bytes_match_the_engine_allocator():
    import torch

    from pagedserve.worker.kv_cache import allocate

    # Grouped-query attention with a head_dim the config states (not hidden / heads = 32).
    model = PlanModel("t", HFConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                    hidden_size=288, head_dim=64, max_position_embeddings=8192))
    assert plan(model, 1, None, 16, "float32", None)["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    # The 8-bit kinds carry a float32 scale per token, head and K/V: plan counts what the allocator takes.
    for name in ("int8", "fp8_e4m3", "bfloat16", "float32"):
        per_token = plan(model, 1, None, 16, name, None)["kv_bytes_per_token"]
        caches = allocate(model.kv_spec(16, name), 2, torch.device("cpu"))
        assert per_token * 16 * 2 == sum(c.numel() * c.element_size() for c in caches)
    assert plan(model, 1, None, 16, "int8", None)["kv_bytes_per_token"] == 2 * 30 * 3 * (64 + 4) == 12240
    with pytest.raises(ValueError, match="auto follows"):
        plan(model, 1, None, 16, "auto", None)


def test_paged_versus_contiguous_counts():
    # 1000 tokens of budget, blocks of 16, context 256, sequences of 40 tokens (3 blocks = 48 slots).
    row = length_row(40, budget_tokens=1000, context=256, block_size=16)
    assert row.paged_seqs == (1000 // 16) // 3 == 20
    assert row.paged_waste == pytest.approx(8 / 48)
    assert row.contiguous_seqs == 3 and row.contiguous_waste == pytest.approx(1 - 40 / 256)


def test_plan_from_hf_config(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "hidden_size": 4096, "max_position_embeddings": 8192}
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    p = plan(read_model(str(tmp_path)), memory_gib=16, context=None, block_size=16, dtype="float16", seq_lens=[1000])
    assert p["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131072  # Llama-3-8B: 128 KiB per token
    assert p["budget_tokens"] == 16 * 2**30 // 131072 == 131072
    assert p["lengths"][0]["contiguous_seqs"] == 16 and p["lengths"][0]["paged_seqs"] == 8192 // 63
    with pytest.raises(ValueError, match="exceeds the context"):
        plan(read_model(str(f)), 16, None, 16, "float16", [9000])
    f.write_text("{}")
    with pytest.raises(ValueError, match="cannot read config.json"):
        read_model(str(f))


def test_plan_from_the_embedded_gguf():
    m = plan(read_model(None), 1, None, 16, "float32", None)["model"]
    assert (m["num_layers"], m["num_kv_heads"], m["head_dim"], m["max_context"]) == (30, 3, 64, 8192)
