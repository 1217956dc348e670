"""Tensor parallelism on CPU over loopback gloo: the sharded model's greedy tokens are TP=1's."""
from __future__ import annotations

import gc
import math

import psutil
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.messages import EngineDeadError
from pagedserve.sampling_params import StructuredOutputsParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
KV_BYTES = 16 << 20


def generate(llm: LLM, params: SamplingParams):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0] for o in outs], [o.prompt_logprobs for o in outs]


def run(model: str | None, tp: int, params: SamplingParams, **kwargs):
    llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory_bytes=KV_BYTES, max_num_seqs=4, **kwargs)
    try:
        return generate(llm, params), llm
    finally:
        llm.llm_engine.core.shutdown()


def assert_same(base, sharded) -> None:
    (outs1, prompt_lps1), (outs_n, prompt_lps_n) = base, sharded
    assert [o.token_ids for o in outs_n] == [o.token_ids for o in outs1]
    # The all-reduce sums partial products in another order, so logprobs agree to float32 rounding only.
    for a, b in zip(outs1, outs_n):
        for lp1, lpn in zip(a.logprobs, b.logprobs):
            for tok, entry in lp1.items():
                assert math.isclose(entry.logprob, lpn[tok].logprob, abs_tol=1e-3)
    for a, b in zip(prompt_lps1, prompt_lps_n):
        assert (a is None) == (b is None)
        for lp1, lpn in zip((a or [])[1:], (b or [])[1:]):
            assert set(lp1) == set(lpn)
            for tok, entry in lp1.items():
                assert math.isclose(entry.logprob, lpn[tok].logprob, abs_tol=1e-3)


def test_heads_that_do_not_divide_are_refused_before_any_process_starts() -> None:
    # The embedded model: 9 heads, 3 KV heads. TP=2 names the constraint and the sizes that work.
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 must divide num_attention_heads \(9\) and "
                                         r"num_key_value_heads \(3\).*\[1, 3\]"):
        LLM(tensor_parallel_size=2, kv_cache_memory_bytes=KV_BYTES)


def test_engine_args_and_cli_flag() -> None:
    import argparse

    args = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["-tp", "3", "--distributed-timeout", "5"])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert (config.parallel.tensor_parallel_size, config.parallel.distributed_timeout_s) == (3, 5.0)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineArgs(tensor_parallel_size=0).create_engine_config()


def test_tp2_tiny_random_model_matches_tp1_and_a_hung_rank_times_out(tiny_tp_dir) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    base, _ = run(tiny_tp_dir, 1, params)
    llm = LLM(tiny_tp_dir, tensor_parallel_size=2, kv_cache_memory_bytes=KV_BYTES, max_num_seqs=4,
              distributed_timeout=5)
    core = llm.llm_engine.core
    try:
        assert_same(base, generate(llm, params))
        assert llm.llm_engine.runner.kv_caches[0].shape[3] == 1  # 2 KV heads / 2 ranks, in every block
        # The plan's grammar bitmask stays on rank 0 (only it samples); constrained requests still obey it.
        choice = SamplingParams(temperature=0.0, max_tokens=8,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        assert {o.outputs[0].text for o in llm.generate(PROMPTS, choice, use_tqdm=False)} <= {"yes", "no"}
        # A rank that stops answering (SIGSTOP: alive, silent) fails the step after the collective timeout.
        worker = psutil.Process(core.executor.worker_pids[0])
        worker.suspend()
        with pytest.raises(EngineDeadError, match="rank 1"):
            llm.generate("Hello", params, use_tqdm=False)
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE  # stopped by the engine
        with pytest.raises(EngineDeadError):  # and every later call fails at once
            llm.generate("Hello", params, use_tqdm=False)
    finally:
        core.shutdown()
    del llm
    gc.collect()


def test_tp3_embedded_model_matches_tp1() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    base, _ = run(None, 1, params)
    sharded, llm = run(None, 3, params)
    assert_same(base, sharded)
    assert llm.llm_engine.runner.kv_caches[0].shape[3] == 1  # 3 KV heads / 3 ranks
    del llm
    gc.collect()
