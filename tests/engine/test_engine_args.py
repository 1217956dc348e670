"""EngineArgs (one set of defaults for LLM, the CLI and the server), resolve_limits, envs. Model-free."""
from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from pagedserve import envs
from pagedserve.cli import build_parser
from pagedserve.config import CHUNKED_PREFILL_BATCHED_TOKENS, EngineConfig, resolve_limits
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.sampling_params import SamplingParams


def _parse(*flags: str) -> argparse.Namespace:
    return EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(list(flags))


def test_defaults_are_the_configs_and_every_field_has_a_flag():
    assert EngineArgs().create_engine_config() == EngineConfig()
    args = _parse()
    assert {f.name for f in dataclasses.fields(EngineArgs)} <= set(vars(args))
    assert EngineArgs.from_cli_args(args) == EngineArgs()


def test_cli_flags_reach_the_config():
    args = _parse("--model", "m.gguf", "--tokenizer", "tok", "--max-model-len", "300", "--dtype", "bfloat16",
                  "--seed", "7", "--block-size", "8", "--kv-cache-memory-bytes", "1000000",
                  "--num-gpu-blocks-override", "40", "--no-enable-prefix-caching", "--swap-space", "0.5",
                  "--preemption-mode", "swap", "--max-num-seqs", "3", "--max-num-batched-tokens", "300",
                  "--no-enable-chunked-prefill", "--device", "cpu", "--num-threads", "2",
                  "--attention-backend", "reference", "--chat-template", "t.jinja", "--scheduling-policy", "priority",
                  "--priority-aging-steps", "7", "--min-num-batched-tokens", "100", "--long-prefill-token-threshold",
                  "64")
    c = EngineArgs.from_cli_args(args).create_engine_config()
    assert (c.model.model, c.model.tokenizer, c.model.max_model_len, c.model.dtype, c.model.seed) == \
        ("m.gguf", "tok", 300, "bfloat16", 7)
    assert (c.model.attention_backend, c.model.chat_template) == ("reference", "t.jinja")
    assert (c.cache.block_size, c.cache.kv_cache_memory_bytes, c.cache.num_gpu_blocks_override) == (8, 10 ** 6, 40)
    assert (c.cache.enable_prefix_caching, c.cache.swap_space_gib, c.cache.preemption_mode) == (False, 0.5, "swap")
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (3, 300)
    assert not c.scheduler.enable_chunked_prefill
    assert (c.scheduler.scheduling_policy, c.scheduler.priority_aging_steps) == ("priority", 7)
    assert (c.scheduler.min_num_batched_tokens, c.scheduler.long_prefill_token_threshold) == (100, 64)
    assert (c.device.device, c.device.num_threads) == ("cpu", 2)


def test_generate_chat_and_serve_share_the_engine_flags():
    parser = build_parser()
    for command in (["generate", "x"], ["chat", "x"], ["serve"]):
        args = parser.parse_args([*command, "--kv-cache-memory", "123", "--no-enable-chunked-prefill"])
        assert EngineArgs.from_cli_args(args) == EngineArgs(kv_cache_memory_bytes=123,
                                                            enable_chunked_prefill=False)


def test_unknown_option_names_the_key():
    with pytest.raises(TypeError, match="no_such_option"):
        EngineArgs(no_such_option=1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=0), "block_size"), (dict(max_model_len=0), "max_model_len"), (dict(dtype="int3"), "dtype"),
    (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes"), (dict(swap_space=-1.0), "swap_space"),
    (dict(num_gpu_blocks_override=0), "num_gpu_blocks_override"), (dict(num_threads=0), "num_threads"),
    (dict(attention_backend="fast"), "attention_backend"), (dict(max_num_batched_tokens=0), "max_num_batched"),
    (dict(scheduling_policy="lifo"), "scheduling_policy"), (dict(priority_aging_steps=0), "priority_aging_steps"),
    (dict(min_num_batched_tokens=0), "min_num_batched"), (dict(long_prefill_token_threshold=-1), "long_prefill"),
    # Known before the model loads: an unchunked prompt of max_model_len tokens could never be scheduled.
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=100, max_model_len=200), "max_num_batched_tokens"),
])
def test_create_engine_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs).create_engine_config()


def _config(**kwargs) -> EngineConfig:
    return EngineArgs(**kwargs).create_engine_config()


def test_model_context_is_capped_to_the_pool_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="pagedserve.config"):
        c = resolve_limits(_config(block_size=16), model_max_len=8192, num_blocks=10)
    assert c.model.max_model_len == 160 and "capping max_model_len to 160" in caplog.text
    assert c.scheduler.max_num_batched_tokens == CHUNKED_PREFILL_BATCHED_TOKENS
    # A context that fits is kept, explicit or not.
    assert resolve_limits(_config(), 100, 10).model.max_model_len == 100
    assert resolve_limits(_config(max_model_len=150), 8192, 10).model.max_model_len == 150


def test_explicit_context_larger_than_pool_or_model_is_an_error():
    with pytest.raises(ValueError, match=r"max_model_len 4096 .*160 tokens.*decrease max_model_len"):
        resolve_limits(_config(max_model_len=4096), 8192, 10)
    with pytest.raises(ValueError, match="exceeds the model's context length 2048"):
        resolve_limits(_config(max_model_len=4096), 2048, 1000)


def test_unchunked_budget_defaults_to_the_context_and_must_cover_it():
    c = resolve_limits(_config(enable_chunked_prefill=False), 8192, 1000)
    assert c.scheduler.max_num_batched_tokens == c.model.max_model_len == 8192
    small = resolve_limits(_config(enable_chunked_prefill=False), 100, 1000)
    assert small.scheduler.max_num_batched_tokens == CHUNKED_PREFILL_BATCHED_TOKENS
    # The model's default context is only known at start: checked there.
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(512\) is smaller than max_model_len \(8192\)"):
        resolve_limits(_config(enable_chunked_prefill=False, max_num_batched_tokens=512), 8192, 1000)


def test_unschedulable_prompt_fails_at_add_and_does_not_block_the_queue():
    config = _config(enable_chunked_prefill=False, max_num_batched_tokens=8).scheduler
    sched = Scheduler(config, KVCacheManager(64, 4, True), max_model_len=64)
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="can never be scheduled"):
        sched.add_request(Request("long", list(range(1, 11)), params, 4, (0,)))
    sched.add_request(Request("short", [1, 2, 3], params, 4, (0,)))
    plan = sched.schedule()
    assert list(plan.num_scheduled_tokens) == ["short"]


def test_envs_are_read_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "0")
    assert envs.cache_dir() == str(tmp_path) and not envs.kernels_enabled()
    monkeypatch.delenv("PAGEDSERVE_CACHE_DIR")
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "1")
    assert envs.cache_dir().endswith("pagedserve") and envs.kernels_enabled()


def test_offline_llm_takes_a_fixed_budget_the_server_an_adaptive_one():
    from pagedserve import LLM
    from pagedserve.config import MIN_BATCHED_TOKENS, OFFLINE_BATCHED_TOKENS

    def budget(llm):
        sched = llm.llm_engine.core.config.scheduler
        return sched.min_num_batched_tokens, sched.max_num_batched_tokens

    assert budget(LLM(num_gpu_blocks_override=256)) == (OFFLINE_BATCHED_TOKENS, OFFLINE_BATCHED_TOKENS)
    assert budget(LLM(num_gpu_blocks_override=256, max_num_batched_tokens=300)) == (300, 300)
    unchunked = LLM(num_gpu_blocks_override=256, enable_chunked_prefill=False)  # sized to the context instead
    assert budget(unchunked) == (256 * 16, 256 * 16) == (unchunked.llm_engine.core.config.model.max_model_len,) * 2
    # The server's engine args (EngineArgs, as `pagedserve serve` builds them) adapt between the two defaults;
    # an explicit maximum keeps the floor unless it is below it (then the budget is fixed).
    sched = lambda **kw: resolve_limits(_config(**kw), 8192, 1000).scheduler  # noqa: E731
    assert (sched().min_num_batched_tokens, sched().max_num_batched_tokens) == \
        (MIN_BATCHED_TOKENS, CHUNKED_PREFILL_BATCHED_TOKENS) == (512, 2048)
    assert sched(max_num_batched_tokens=4096).min_num_batched_tokens == 512
    assert sched(max_num_batched_tokens=256).min_num_batched_tokens == 256
    assert sched(max_num_batched_tokens=4096, min_num_batched_tokens=1024).min_num_batched_tokens == 1024
    with pytest.raises(ValueError, match=r"min_num_batched_tokens \(1024\) must not exceed"):
        sched(min_num_batched_tokens=1024, max_num_batched_tokens=600)
    with pytest.raises(ValueError, match=r"min_num_batched_tokens \(4096\) must not exceed"):
        sched(min_num_batched_tokens=4096)
