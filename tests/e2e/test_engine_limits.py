"""Start-up limits on the embedded model: a context the KV pool cannot hold (issue 10, defect 5), an unchunked
token budget that could never admit a long prompt (defect 8), and the --tokenizer option (defect 10)."""
from __future__ import annotations

import os
import threading

import pytest
from transformers import AutoTokenizer

from pagedserve import LLM, SamplingParams
from pagedserve.model.loader import default_model_path

CHAT = [{"role": "user", "content": "Say hi."}]


def test_default_context_is_capped_to_the_pool_and_default_max_tokens_fit():
    llm = LLM(num_gpu_blocks_override=3, block_size=16)  # 48 tokens, far below the model's 8192
    assert llm.llm_engine.max_model_len == 48
    out = llm.chat(CHAT, SamplingParams(temperature=0, ignore_eos=True, max_tokens=None),
                   use_tqdm=False)[0]
    # Without max_tokens a request may use the whole context: prompt + output == max_model_len.
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 48
    assert out.outputs[0].finish_reason == "length"


def test_explicit_context_larger_than_the_pool_fails_at_start():
    with pytest.raises(ValueError, match=r"max_model_len 1024 does not fit the KV cache, which holds 96 tokens"):
        LLM(max_model_len=1024, num_gpu_blocks_override=6, block_size=16)


def _run_with_timeout(fn, timeout_s: float = 120.0):
    # Before the fix this spun forever inside LLM.generate; a daemon thread keeps the test from hanging too.
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "hung: the engine never admitted the request"
    return result


def test_unchunked_budget_smaller_than_the_context_fails_at_start_instead_of_hanging():
    long_prompt = "one two three four five six seven eight nine ten " * 4

    def build_and_generate():
        llm = LLM(num_gpu_blocks_override=16, enable_chunked_prefill=False, max_num_batched_tokens=16)
        return llm.generate(long_prompt, SamplingParams(max_tokens=2), use_tqdm=False)

    result = _run_with_timeout(build_and_generate)
    assert isinstance(result.get("error"), ValueError), result
    assert "max_num_batched_tokens (16) is smaller than max_model_len (256)" in str(result["error"])


def test_tokenizer_directory_is_loaded(tmp_path):
    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\nTOKENIZER-DIR {{ m['content'] }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(tmp_path / "tok")
    llm = LLM(tokenizer=str(tmp_path / "tok"), num_gpu_blocks_override=8)
    out = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>user\nTOKENIZER-DIR Say hi.")

    # A tokenizer with ids past the model's vocabulary is refused at load, not inside a step.
    tok.add_special_tokens({"additional_special_tokens": ["<|probe-a|>", "<|probe-b|>"]})
    tok.save_pretrained(tmp_path / "big")
    with pytest.raises(ValueError, match="more than the model's vocabulary"):
        LLM(tokenizer=str(tmp_path / "big"), num_gpu_blocks_override=8)
    with pytest.raises(ValueError, match="tokenizer path is not a directory"):
        LLM(tokenizer=str(tmp_path / "missing"), num_gpu_blocks_override=8)
