"""--kv-offload-dir end to end: a restarted engine takes a prompt's prefix from disk, byte for byte, and
generates what an engine without the disk tier generates; bad files are recomputed; bad configs refused."""
from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.worker.kv_offload import read_blocks
from tests.tiny_models import random_hf_model, save_hf_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = {"prompt_token_ids": [300 + (i * 37) % 5000 for i in range(90)]}  # 5 full blocks + 10 tokens
NUM_PROMPT_BLOCKS = 5


def tiny_model(tmp_path_factory, name: str, **shape) -> str:
    from pagedserve.model.loader import resolve_model_dir

    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_dir(None)[0])
    config = transformers.LlamaConfig(**{**dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2), **shape},
                                      vocab_size=len(tokenizer), max_position_embeddings=256)
    return save_hf_dir(random_hf_model(config, scale=0.3), tokenizer, tmp_path_factory.mktemp("kvdisk") / name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory, "tiny")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):  # another geometry than the target's: 1 layer, 1 KV head of 32
    return tiny_model(tmp_path_factory, "draft", hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)


def engine(model_dir: str, kv_dir=None, **kwargs) -> LLM:
    return LLM(model=model_dir, kv_cache_memory_bytes=1 << 20, kv_offload_dir=kv_dir and str(kv_dir), **kwargs)


def run(llm: LLM):
    [out] = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    core = llm.llm_engine.core
    if core.kv.disk is not None:
        core.kv.disk.flush()
    return out


def prompt_kv(llm: LLM, req_blocks: list[int]) -> list[bytes]:
    return [bytes(b) for b in read_blocks(llm.llm_engine.core.runner.kv_caches, req_blocks)]


def draft_kv(llm: LLM, req_blocks: list[int]) -> list[bytes]:
    return [bytes(b) for b in read_blocks(llm.llm_engine.core.executor.proposer.kv_caches, req_blocks)]


def prompt_hashes(llm: LLM) -> list[bytes]:
    from pagedserve.core.request import Request

    kv = llm.llm_engine.core.kv
    req = Request("probe", PROMPT["prompt_token_ids"], GREEDY, 1, (), 0.0)
    hashes = list(kv._block_hashes(req, NUM_PROMPT_BLOCKS))
    kv.req_hashes.pop("probe")
    return hashes


def cached_block_ids(llm: LLM) -> list[int]:
    # The prompt's full blocks as the pool caches them, in prompt order.
    return [llm.llm_engine.core.kv.pool.lookup(h).block_id for h in prompt_hashes(llm)]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])  # int8: rows carry their scales
def test_restarted_engine_loads_the_prefix_and_generates_the_same(model_dir, tmp_path, kv_dtype):
    reference = run(engine(model_dir, kv_cache_dtype=kv_dtype))          # no disk tier
    first = engine(model_dir, tmp_path, kv_cache_dtype=kv_dtype)
    cold = run(first)
    assert cold.num_cached_tokens == 0
    assert first.llm_engine.core.kv.disk.stats.num_stored_blocks >= NUM_PROMPT_BLOCKS
    computed_kv = prompt_kv(first, cached_block_ids(first))
    del first

    second = engine(model_dir, tmp_path, num_gpu_blocks_override=40, kv_cache_dtype=kv_dtype)  # other block ids
    warm = run(second)
    stats = second.llm_engine.core.kv.disk.stats
    assert stats.num_loaded_blocks == NUM_PROMPT_BLOCKS and stats.num_hit_tokens == 16 * NUM_PROMPT_BLOCKS
    assert warm.num_cached_tokens == 16 * NUM_PROMPT_BLOCKS
    assert prompt_kv(second, cached_block_ids(second)) == computed_kv    # the same bytes, not recomputed ones
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids == reference.outputs[0].token_ids
    text = scrape(second)
    assert f'vllm:kv_offload_loaded_blocks_total{{model_name="m"}} {NUM_PROMPT_BLOCKS}.0' in text
    assert f'vllm:kv_offload_hit_tokens_total{{model_name="m"}} {16 * NUM_PROMPT_BLOCKS}.0' in text
    # The generated tokens' block, already on disk from the first engine: checked, not written again.
    [cpu] = re.findall(r'vllm:kv_offload_writer_cpu_seconds_total\{model_name="m"\} (\S+)', text)
    assert float(cpu) > 0


def test_draft_models_kv_is_stored_and_loaded_with_the_block(model_dir, draft_dir, tmp_path):
    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 2}
    first = engine(model_dir, tmp_path, speculative_config=spec)
    cold = run(first)
    ids = cached_block_ids(first)
    computed = prompt_kv(first, ids), draft_kv(first, ids)
    assert any(any(b) for b in computed[1])                              # the draft ran over the prompt
    del first
    second = engine(model_dir, tmp_path, speculative_config=spec, num_gpu_blocks_override=40)
    warm = run(second)
    assert second.llm_engine.core.kv.disk.stats.num_loaded_blocks == NUM_PROMPT_BLOCKS
    ids = cached_block_ids(second)
    assert (prompt_kv(second, ids), draft_kv(second, ids)) == computed  # both models' K/V, byte for byte
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    # Files with a draft's K/V are not another layout's: an engine without the draft does not read them.
    third = engine(model_dir, tmp_path)
    run(third)
    assert third.llm_engine.core.kv.disk.stats.num_loaded_blocks == 0


def test_warmup_is_cleared_once_its_blocks_are_written(model_dir, tmp_path):
    # The server's warm-up ends with clear_warmup: blocks the writer still reads from the pool are pinned.
    llm = engine(model_dir, tmp_path)
    core = llm.llm_engine.core
    # 90 + 7 tokens: the last step computes token 96, the end of the sixth block, pinned as generate returns.
    llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    core.clear_warmup()
    assert core.kv.pool.num_free_blocks == core.kv.num_blocks and core.kv.pool.cached == {}
    assert core.kv.disk.stats.num_stored_blocks == NUM_PROMPT_BLOCKS + 1


def scrape(llm: LLM) -> str:
    # What /metrics exports from this engine's counters (the collector the server registers).
    from prometheus_client import CollectorRegistry, generate_latest

    from pagedserve.engine.async_engine import EngineSnapshot
    from pagedserve.metrics.prometheus import _SnapshotCollector

    core = llm.llm_engine.core
    engine = SimpleNamespace(snapshot=EngineSnapshot(core.scheduler.stats(), 0, 0, {}, 0), block_size=16,
                             num_kv_blocks=core.num_kv_blocks, kv_cache_dtype="float32", kv_bytes_per_token=0)
    registry = CollectorRegistry()
    registry.register(_SnapshotCollector(engine, "m", "vllm"))
    return generate_latest(registry).decode()


def test_corrupt_block_is_recomputed(model_dir, tmp_path):
    first = engine(model_dir, tmp_path)
    cold = run(first)
    third = first.llm_engine.core.kv.disk.path(prompt_hashes(first)[2])
    with open(third, "r+b") as f:                            # the prompt's third block, one byte changed
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    llm = engine(model_dir, tmp_path)
    out = run(llm)
    stats = llm.llm_engine.core.kv.disk.stats
    assert stats.num_corrupt_blocks == 1 and stats.num_loaded_blocks == 2   # the blocks before it
    assert out.num_cached_tokens == 32
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    assert stats.num_stored_blocks >= 1 and os.path.exists(third)   # recomputed, written again


@pytest.mark.parametrize("kwargs, match", [
    (dict(enable_prefix_caching=False), "prefix caching"),
    (dict(tensor_parallel_size=2), "tensor-parallel"),
])
def test_unsupported_configs_are_refused(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(kv_offload_dir=str(tmp_path), **kwargs).create_engine_config()


def test_bound_without_directory_is_refused():
    with pytest.raises(ValueError, match="kv-offload-dir"):
        EngineArgs(kv_offload_max_bytes=1 << 20).create_engine_config()


def test_cli_flags_reach_the_config(tmp_path):
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-offload-dir", str(tmp_path), "--kv-offload-max-bytes", "1000000"])
    cache = EngineArgs.from_cli_args(args).create_engine_config().cache
    assert (cache.kv_offload_dir, cache.kv_offload_max_bytes) == (str(tmp_path), 1000000)
