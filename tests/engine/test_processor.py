"""The front-end's input side (engine/processor.py) against the embedded model's own tokenizer and chat template:
prompt forms, validation, samples forked from the first, chat rendering."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers

from pagedserve.config import ModelConfig, SchedulerConfig
from pagedserve.engine.processor import ChatPrompt, Processor
from pagedserve.model.loader import resolve_model_dir
from pagedserve.sampling_params import SamplingParams

MAX_LEN = 64
EOS = (2, 7)


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(resolve_model_dir(None)[0])


def make_processor(tokenizer, policy: str = "fcfs") -> Processor:
    loaded = SimpleNamespace(tokenizer=tokenizer, hf_config=SimpleNamespace(vocab_size=len(tokenizer)),
                             eos_token_ids=list(EOS), chat_template=tokenizer.chat_template)
    # A model path set: the model's own template, not the embedded tool-use one.
    return Processor(loaded, ModelConfig(model="local"), MAX_LEN, None, SchedulerConfig(scheduling_policy=policy))


@pytest.fixture(scope="module")
def proc(tokenizer):
    return make_processor(tokenizer)


def test_prompt_forms_tokenize_as_the_tokenizer_does(proc, tokenizer) -> None:
    text = "The capital of France is"
    ids = tokenizer.encode(text)
    assert proc.tokenize(text) == (text, ids)
    assert proc.tokenize(ids) == (None, ids)
    assert proc.tokenize({"prompt": text}) == (text, ids)
    assert proc.tokenize({"prompt_token_ids": ids[:3]}) == (None, ids[:3])


@pytest.mark.parametrize("prompt, match", [
    ("", "empty"),
    ([], "empty"),
    ([1, -1], r"token ids must be integers in \[0, "),
    ([1, True], "token ids must be integers"),
    ({"text": "hi"}, "needs 'prompt' or 'prompt_token_ids'"),
    (3.5, "unsupported prompt type"),
    ([5] * MAX_LEN, f"max_model_len is {MAX_LEN}"),
    ({"prompt": "hi", "cache_salt": ""}, "cache_salt"),
])
def test_bad_prompts_are_value_errors(proc, prompt, match) -> None:
    with pytest.raises(ValueError, match=match):
        proc.process("r", prompt, SamplingParams())


def test_samples_fork_the_first_and_inherit_what_they_should(proc, tokenizer) -> None:
    ids = tokenizer.encode("one two three")
    p = proc.process("r", ids, SamplingParams(n=3, seed=10, prompt_logprobs=2, max_tokens=5), arrival_time=1.5)
    reqs = p.core_requests
    assert [r.req_id for r in reqs] == ["r#0", "r#1", "r#2"]
    assert [r.fork_of for r in reqs] == [None, "r#0", "r#0"]
    assert [r.params.seed for r in reqs] == [10, 11, 12]
    assert [r.params.prompt_logprobs for r in reqs] == [2, None, None]  # the request scores its prompt once
    assert all(r.params.n == 1 and r.prompt_token_ids == ids and r.max_tokens == 5 and r.eos_token_ids == EOS
               and r.arrival_time == 1.5 and r.client_request_id == "r" for r in reqs)
    single = proc.process("s", ids, SamplingParams(max_tokens=None)).core_requests  # the rest of the context
    assert [r.req_id for r in single] == ["s"] and single[0].max_tokens == MAX_LEN - len(ids)


def test_best_of_asks_the_core_for_logprobs_to_rank_and_drops_them(proc) -> None:
    p = proc.process("r", [5, 6], SamplingParams(n=1, best_of=3))
    assert len(p.core_requests) == 3 and p.num_returned == 1 and not p.keep_logprobs
    assert all(r.params.logprobs == 0 for r in p.core_requests)


def test_max_tokens_past_the_context_and_bad_param_ids(proc) -> None:
    with pytest.raises(ValueError, match="maximum context length is 64"):
        proc.process("r", [5] * 60, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="stop_token_ids must be token ids"):
        proc.process("r", [5], SamplingParams(stop_token_ids=[10**7]))


def test_priority_needs_the_priority_policy(proc, tokenizer) -> None:
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        proc.process("r", [5], SamplingParams(), priority=3)
    reqs = make_processor(tokenizer, "priority").process("r", [5], SamplingParams(), priority=3).core_requests
    assert reqs[0].priority == 3


def test_chat_prompt_renders_with_the_models_template(proc, tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    chat = ChatPrompt(messages, cache_salt="tenant-a")
    assert proc.render_chat(chat) == {"prompt": text, "prompt_token_ids": ids, "cache_salt": "tenant-a"}
    p = proc.process("c", chat, SamplingParams())
    assert p.prompt == text and p.prompt_token_ids == ids
    assert p.core_requests[0].cache_salt == "tenant-a"
    no_gen = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert proc.tokenize(ChatPrompt(messages, add_generation_prompt=False))[0] == no_gen != text
    with pytest.raises(ValueError, match="non-empty list"):
        proc.render_chat(ChatPrompt([]))
