"""POST /v1/chat/completions through the official openai client against a live server."""
from __future__ import annotations

import pytest

from tests.server.conftest import CHATS, GREEDY_MAX_TOKENS


def collect(stream):
    texts: dict[int, str] = {}
    roles: dict[int, str] = {}
    reasons: dict[int, str] = {}
    logprobs: dict[int, list] = {}
    usage = None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.logprobs is not None and c.logprobs.content:
                logprobs.setdefault(c.index, []).extend(c.logprobs.content)
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, roles, reasons, logprobs, usage


@pytest.mark.parametrize("case", range(len(CHATS)))
def test_chat_greedy_matches_offline_llm(client, model_name, expected, case):
    want = expected["chat"][case]
    resp = client.chat.completions.create(model=model_name, messages=CHATS[case], max_tokens=GREEDY_MAX_TOKENS,
                                          temperature=0.0)
    assert resp.object == "chat.completion"
    [choice] = resp.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == want.outputs[0].text
    assert choice.finish_reason == want.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == len(want.outputs[0].token_ids)


@pytest.mark.parametrize("case", range(len(CHATS)))
def test_chat_stream_equals_non_streamed(client, model_name, expected, case):
    want = expected["chat"][case]
    stream = client.chat.completions.create(model=model_name, messages=CHATS[case],
                                            max_completion_tokens=GREEDY_MAX_TOKENS, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    texts, roles, reasons, _, usage = collect(stream)
    assert texts == {0: want.outputs[0].text}
    assert roles == {0: "assistant"}
    assert reasons == {0: want.outputs[0].finish_reason}
    assert usage.prompt_tokens == len(want.prompt_token_ids)
    assert usage.completion_tokens == len(want.outputs[0].token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_max_completion_tokens_wins_over_max_tokens(client, model_name):
    resp = client.chat.completions.create(model=model_name, messages=CHATS[0], max_tokens=20,
                                          max_completion_tokens=3, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3
    assert resp.choices[0].finish_reason == "length"


def test_chat_logprobs(client, model_name, expected):
    resp = client.chat.completions.create(model=model_name, messages=CHATS[0], max_tokens=8, temperature=0.0,
                                          logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    stream = client.chat.completions.create(model=model_name, messages=CHATS[0], max_tokens=8, temperature=0.0,
                                            logprobs=True, top_logprobs=2, stream=True)
    _, _, _, streamed, _ = collect(stream)
    assert [(e.token, round(e.logprob, 5)) for e in streamed[0]] == \
        [(e.token, round(e.logprob, 5)) for e in content]
    # Without top_logprobs only the chosen token is reported.
    resp = client.chat.completions.create(model=model_name, messages=CHATS[0], max_tokens=4, temperature=0.0,
                                          logprobs=True)
    assert all(e.top_logprobs == [] for e in resp.choices[0].logprobs.content)


def test_chat_n_2_stream(client, model_name):
    kw = dict(model=model_name, messages=CHATS[1], max_tokens=6, n=2, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    resp = client.chat.completions.create(**kw)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage.completion_tokens == 12
    texts, roles, reasons, _, usage = collect(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert texts == {c.index: c.message.content for c in resp.choices}
    assert roles == {0: "assistant", 1: "assistant"}
    assert reasons == {0: "length", 1: "length"}
    assert usage.completion_tokens == 12


def test_chat_stop_string(client, model_name, expected):
    full = expected["chat"][0].outputs[0].text
    stop = full[4:7]
    resp = client.chat.completions.create(model=model_name, messages=CHATS[0], max_tokens=GREEDY_MAX_TOKENS,
                                          temperature=0.0, stop=stop)
    assert resp.choices[0].message.content == full[:full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"
