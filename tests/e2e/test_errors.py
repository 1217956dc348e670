"""Bad input raises ValueError naming the problem, and leaves the engine usable."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve import LLM, SamplingParams


@pytest.mark.parametrize("prompt, params, match", [
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "empty"),
    ("hello", SamplingParams(max_tokens=10_000), "maximum context length"),
    ([1, 2, 10 ** 9], SamplingParams(), "token ids"),
])
def test_bad_requests_raise_and_leave_engine_clean(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params, use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks
    assert llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_prompt_that_can_never_fit_the_pool_is_rejected():
    small = LLM(num_gpu_blocks_override=2, block_size=4)
    # max_model_len is capped to the pool's 8 tokens at start, so the context check refuses it first.
    with pytest.raises(ValueError, match="never fit|maximum context length is 8 tokens"):
        small.generate("one two three four five six seven", SamplingParams(max_tokens=4), use_tqdm=False)
    assert not small.llm_engine.has_unfinished_requests()


def test_unknown_model_path_and_bad_options(tmp_path):
    with pytest.raises(ValueError, match="does not exist|not found|no such"):
        LLM(str(tmp_path / "missing.gguf"))
    with pytest.raises(TypeError):
        LLM(no_such_option=1)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(max_model_len=10 ** 6)


def test_cli_generate_greedy_matches_python(llm):
    out = subprocess.run([sys.executable, "-m", "pagedserve.cli", "generate", "The capital of France is",
                          "--max-tokens", "8", "--kv-cache-memory", str(16 << 20)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    expected = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8),
                            use_tqdm=False)[0].outputs[0].text
    assert out.stdout.strip() == ("The capital of France is" + expected).strip()
    bad = subprocess.run([sys.executable, "-m", "pagedserve.cli", "generate", "x", "--top-p", "2"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "top_p" in bad.stderr
