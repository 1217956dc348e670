"""POST /v1/completions through the official openai client against a live server."""
from __future__ import annotations

import pytest

from tests.server.conftest import GREEDY_MAX_TOKENS, GREEDY_PROMPTS, TOKEN_ID_PROMPT


def greedy(client, model_name, prompt, **kw):
    return client.completions.create(model=model_name, prompt=prompt, max_tokens=GREEDY_MAX_TOKENS,
                                     temperature=0.0, **kw)


def stream_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                assert c.index not in reasons, "a choice finished twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


@pytest.mark.parametrize("prompt", GREEDY_PROMPTS)
def test_greedy_matches_offline_llm(client, model_name, expected, prompt):
    want = expected["completion"][prompt]
    resp = greedy(client, model_name, prompt)
    assert resp.object == "text_completion" and resp.model == model_name
    [choice] = resp.choices
    assert choice.text == want.outputs[0].text
    assert choice.finish_reason == want.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


@pytest.mark.parametrize("prompt", GREEDY_PROMPTS)
def test_streamed_text_equals_non_streamed(client, model_name, expected, prompt):
    want = expected["completion"][prompt]
    stream = greedy(client, model_name, prompt, stream=True, stream_options={"include_usage": True})
    texts, reasons, usage = stream_text(stream)
    assert texts == {0: want.outputs[0].text}
    assert reasons == {0: want.outputs[0].finish_reason}
    assert usage.prompt_tokens == len(want.prompt_token_ids)
    assert usage.completion_tokens == len(want.outputs[0].token_ids)


def test_stream_without_include_usage_has_no_usage_chunk(client, model_name):
    chunks = list(client.completions.create(model=model_name, prompt="Hello", max_tokens=4, temperature=0.0,
                                            stream=True))
    assert chunks and all(c.usage is None and len(c.choices) == 1 for c in chunks)


def test_token_id_prompts(client, model_name, expected):
    want = expected["token_ids"]
    resp = greedy(client, model_name, TOKEN_ID_PROMPT)
    assert resp.choices[0].text == want.outputs[0].text
    assert resp.usage.prompt_tokens == len(TOKEN_ID_PROMPT)
    # A list of token-id lists is a batch; choices come back in prompt order.
    resp = greedy(client, model_name, [TOKEN_ID_PROMPT, TOKEN_ID_PROMPT[:2]])
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[0].text == want.outputs[0].text
    assert resp.usage.prompt_tokens == len(TOKEN_ID_PROMPT) + 2


def test_list_of_string_prompts(client, model_name, expected):
    resp = greedy(client, model_name, GREEDY_PROMPTS)
    assert [c.index for c in resp.choices] == list(range(len(GREEDY_PROMPTS)))
    for choice, prompt in zip(resp.choices, GREEDY_PROMPTS):
        assert choice.text == expected["completion"][prompt].outputs[0].text
    assert resp.usage.prompt_tokens == sum(len(expected["completion"][p].prompt_token_ids) for p in GREEDY_PROMPTS)
    stream = greedy(client, model_name, GREEDY_PROMPTS, stream=True, stream_options={"include_usage": True})
    texts, _, usage = stream_text(stream)
    assert texts == {i: c.text for i, c in enumerate(resp.choices)}
    assert usage.completion_tokens == resp.usage.completion_tokens


def test_n_2_sampling(client, model_name):
    resp = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=8, n=2,
                                     temperature=0.9, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 16
    # Seeded sampling is reproducible, streamed or not.
    stream = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=8, n=2,
                                       temperature=0.9, seed=7, extra_body={"ignore_eos": True}, stream=True,
                                       stream_options={"include_usage": True})
    texts, reasons, usage = stream_text(stream)
    assert texts == {c.index: c.text for c in resp.choices}
    assert reasons == {0: "length", 1: "length"}
    assert usage.completion_tokens == 16 and usage.prompt_tokens == resp.usage.prompt_tokens


def test_logprobs_legacy_format(client, model_name, expected):
    prompt = GREEDY_PROMPTS[0]
    resp = greedy(client, model_name, prompt, logprobs=3)
    choice = resp.choices[0]
    lp = choice.logprobs
    n = resp.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert choice.text == expected["completion"][prompt].outputs[0].text
    offset = 0
    for token, logprob, top, off in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert off == offset
        offset += len(token)
        assert logprob <= 0.0
        assert 1 <= len(top) <= 4 and token in top
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert "".join(lp.tokens).startswith(choice.text)
    # Streamed logprobs line up with the same tokens.
    streamed = []
    for chunk in greedy(client, model_name, prompt, logprobs=3, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed.extend(zip(c.logprobs.tokens, c.logprobs.text_offset))
    assert streamed == list(zip(lp.tokens, lp.text_offset))


def test_stop_strings(client, model_name, expected):
    prompt = GREEDY_PROMPTS[0]
    full = expected["completion"][prompt].outputs[0].text
    # A stop string taken from the middle of the greedy answer cuts it right before that string.
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full[:full.index(stop)]
    resp = greedy(client, model_name, prompt, stop=[stop, "never-appears"])
    assert resp.choices[0].text == cut
    assert resp.choices[0].finish_reason == "stop"
    assert resp.model_dump()["choices"][0]["stop_reason"] == stop
    texts, reasons, _ = stream_text(greedy(client, model_name, prompt, stop=stop, stream=True))
    assert texts == {0: cut} and reasons == {0: "stop"}
    resp = greedy(client, model_name, prompt, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert resp.choices[0].text == cut + stop


def test_echo(client, model_name, expected):
    prompt = GREEDY_PROMPTS[1]
    want = expected["completion"][prompt].outputs[0].text
    resp = greedy(client, model_name, prompt, echo=True)
    assert resp.choices[0].text == prompt + want
    texts, _, _ = stream_text(greedy(client, model_name, prompt, echo=True, stream=True))
    assert texts == {0: prompt + want}
    resp = greedy(client, model_name, TOKEN_ID_PROMPT, echo=True)
    assert resp.choices[0].text == expected["token_ids_text"] + expected["token_ids"].outputs[0].text


def test_sampling_extras_and_min_tokens(client, model_name):
    resp = client.completions.create(
        model=model_name, prompt="The weather today", max_tokens=6, temperature=0.7, top_p=0.9, seed=3,
        presence_penalty=0.5, frequency_penalty=0.5, user="tester",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 6, "ignore_eos": True})
    assert resp.usage.completion_tokens == 6
    assert resp.choices[0].finish_reason == "length"
