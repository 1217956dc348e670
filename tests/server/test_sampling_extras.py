"""logit_bias, allowed_token_ids and best_of through the official openai client against a live server."""
from __future__ import annotations

import httpx
import openai
import pytest

TOKEN = 12_345  # an ordinary BPE token of SmolLM2's 49,152-token vocabulary


def detokenize(server, ids: list[int]) -> str:
    return httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]


def test_logit_bias_forces_and_bans_tokens(server, client, model_name):
    detok = detokenize(server, [TOKEN])
    forced = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=4,
                                       temperature=0.0, logit_bias={str(TOKEN): 100})
    assert forced.choices[0].text == detok * 4
    plain = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=1,
                                      temperature=0.0, logprobs=1)
    first = plain.choices[0].text
    banned_id = httpx.post(f"{server.url}/tokenize", json={"prompt": first, "add_special_tokens": False},
                           timeout=30).json()["tokens"]
    assert len(banned_id) == 1
    other = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=1,
                                      temperature=0.0, logit_bias={str(banned_id[0]): -100})
    assert other.choices[0].text != first


def test_allowed_token_ids_restrict_sampling(server, client, model_name):
    allowed = [TOKEN, 504, 2988]
    allowed_texts = {detokenize(server, [t]) for t in allowed}
    resp = client.completions.create(model=model_name, prompt="Hello", max_tokens=8, temperature=1.0, seed=3,
                                      logprobs=0, extra_body={"allowed_token_ids": allowed})
    assert len(resp.choices[0].logprobs.tokens) == 8
    assert set(resp.choices[0].logprobs.tokens) <= allowed_texts


def test_best_of_returns_the_most_likely_of_the_samples(client, model_name):
    # best_of=3 samples the same three sequences as n=3 with the same seed (sample i uses seed + i) and
    # returns the one with the highest cumulative logprob.
    kw = dict(model=model_name, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11, logprobs=0)
    all3 = client.completions.create(n=3, **kw)
    best = max(all3.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    one = client.completions.create(n=1, best_of=3, **kw)
    assert [c.text for c in one.choices] == [best.text]
    two = client.completions.create(n=2, best_of=3, **kw)
    ranked = sorted(all3.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert sorted(c.text for c in two.choices) == sorted(c.text for c in ranked[:2])


@pytest.mark.parametrize("kw, needle", [
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(logit_bias={"abc": 1}), "logit_bias"),
    (dict(logit_bias={"99999999": 1}), "logit_bias"),
    (dict(extra_body={"allowed_token_ids": []}), "allowed_token_ids"),
    (dict(extra_body={"allowed_token_ids": [10**9]}), "allowed_token_ids"),
    (dict(best_of=1, n=2), "best_of"),
    (dict(best_of=3, stream=True), "best_of"),
    (dict(best_of=2, temperature=0.0), "best_of"),
])
def test_bad_extras_are_400(client, model_name, kw, needle):
    kw = {"temperature": 1.0, **kw}
    with pytest.raises(openai.BadRequestError) as err:
        resp = client.completions.create(model=model_name, prompt="Hi", max_tokens=2, **kw)
        if kw.get("stream"):
            list(resp)
    assert needle in str(err.value)
    # The server keeps serving.
    assert client.completions.create(model=model_name, prompt="Hi", max_tokens=1, temperature=0.0).choices
