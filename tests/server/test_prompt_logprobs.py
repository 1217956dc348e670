"""Prompt logprobs over HTTP: completions echo with logprobs (OpenAI's format) and vLLM's prompt_logprobs field."""
from __future__ import annotations

import pytest

from tests.server.conftest import ECHO_LOGPROBS, ECHO_MAX_TOKENS, ECHO_PROMPT
from tests.server.test_errors import assert_openai_error, post

TOL = 1e-4


def echo(client, model_name, **kw):
    return client.completions.create(model=model_name, prompt=ECHO_PROMPT, max_tokens=ECHO_MAX_TOKENS,
                                     temperature=0.0, echo=True, logprobs=ECHO_LOGPROBS,
                                     extra_body={"ignore_eos": True}, **kw)


def test_echo_with_logprobs_covers_prompt_then_output(client, model_name, expected):
    want = expected["echo"]
    prompt_ids, gen = want.prompt_token_ids, want.outputs[0]
    resp = echo(client, model_name)
    [choice] = resp.choices
    lp = choice.logprobs
    n_prompt = len(prompt_ids)
    assert resp.usage.prompt_tokens == n_prompt and resp.usage.completion_tokens == ECHO_MAX_TOKENS
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.token_logprobs) == n_prompt + ECHO_MAX_TOKENS
    assert choice.text == ECHO_PROMPT + gen.text
    # Nothing predicts the first prompt token.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # Prompt tokens, then generated tokens, each with the offline LLM's logprob.
    entries = want.prompt_logprobs[1:] + gen.logprobs
    assert len(entries) == len(lp.tokens) - 1
    for k, (tid, entry) in enumerate(zip(prompt_ids[1:] + gen.token_ids, entries), start=1):
        assert lp.token_logprobs[k] == pytest.approx(entry[tid].logprob, abs=TOL), k
        assert lp.tokens[k] == entry[tid].decoded_token
        top = lp.top_logprobs[k]
        assert lp.tokens[k] in top and len(top) <= ECHO_LOGPROBS + 1
    # text_offset runs on across the prompt into the output.
    assert lp.text_offset[0] == 0
    for k in range(1, len(lp.tokens)):
        assert lp.text_offset[k] == lp.text_offset[k - 1] + len(lp.tokens[k - 1])
    assert "".join(lp.tokens) == choice.text


def test_streamed_echo_logprobs_equal_non_streamed(client, model_name):
    whole = echo(client, model_name).choices[0].logprobs
    tokens, token_logprobs, offsets, tops, text = [], [], [], [], ""
    for chunk in echo(client, model_name, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                token_logprobs += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
                tops += c.logprobs.top_logprobs
    assert text.startswith(ECHO_PROMPT)
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert token_logprobs[0] is None and tops[0] is None
    assert token_logprobs[1:] == pytest.approx(whole.token_logprobs[1:], abs=TOL)


def test_prompt_logprobs_field_on_completions_and_chat(client, model_name, expected):
    want = expected["echo"]
    resp = client.completions.create(model=model_name, prompt=ECHO_PROMPT, max_tokens=2, temperature=0.0,
                                     extra_body={"prompt_logprobs": 1})
    # vLLM's layout: on each completion choice, token ids as string keys, None first.
    field = resp.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(field) == len(want.prompt_token_ids) and field[0] is None
    for tid, entry, ref in zip(want.prompt_token_ids[1:], field[1:], want.prompt_logprobs[1:]):
        assert str(tid) in entry and len(entry) <= 2
        assert min(e["rank"] for e in entry.values()) == 1
        got = entry[str(tid)]
        assert got["logprob"] == pytest.approx(ref[tid].logprob, abs=TOL)
        assert got["rank"] == ref[tid].rank and got["decoded_token"] == ref[tid].decoded_token
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=2, extra_body={"prompt_logprobs": 0})
    field = chat.model_dump()["prompt_logprobs"]  # top level for chat, as vLLM
    assert len(field) == chat.usage.prompt_tokens and field[0] is None
    assert all(len(entry) == 1 for entry in field[1:])
    plain = client.completions.create(model=model_name, prompt=ECHO_PROMPT, max_tokens=1)
    assert plain.model_dump()["choices"][0].get("prompt_logprobs") is None


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 21}),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}),  # vLLM refuses this too
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 99}),
])
def test_bad_prompt_logprobs_are_400(server, path, body):
    err = assert_openai_error(post(server, path, json=body), 400)
    assert err["type"] == "invalid_request_error"
