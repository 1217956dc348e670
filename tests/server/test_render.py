"""The render endpoints (a request's token ids as the engine sees them, in vLLM's GenerateRequest shape) and
/ready, against the live server: render's ids are checked against the offline LLM's prompt ids and against the
ids the engine reports for the same request (prompt_logprobs keys, usage)."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import ECHO_PROMPT
from tests.server.test_errors import assert_openai_error

GENERATE_REQUEST_KEYS = {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                         "stream_options", "cache_salt", "priority", "kv_transfer_params"}


def engine_prompt_ids(field: list) -> list[int]:
    # prompt_logprobs with 0 alternatives: position i > 0 holds exactly the prompt's token i.
    assert field[0] is None and all(len(entry) == 1 for entry in field[1:])
    return [int(next(iter(entry))) for entry in field[1:]]


def test_completions_render_matches_the_engines_prompt(server, client, model_name, expected):
    body = {"model": model_name, "prompt": [ECHO_PROMPT, "Hello there"], "max_tokens": 7, "temperature": 0.5,
            "cache_salt": "tenant-1"}
    resp = httpx.post(f"{server.url}/v1/completions/render", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    rendered = resp.json()
    assert isinstance(rendered, list) and len(rendered) == 2
    assert all(set(r) == GENERATE_REQUEST_KEYS for r in rendered)
    assert rendered[0]["token_ids"] == expected["echo"].prompt_token_ids      # the offline LLM's ids
    hello = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    assert rendered[1]["token_ids"] == hello
    first = rendered[0]
    assert (first["model"], first["cache_salt"], first["features"], first["stream"]) == (model_name, "tenant-1",
                                                                                        None, False)
    assert first["sampling_params"]["max_tokens"] == 7 and first["sampling_params"]["temperature"] == 0.5
    assert rendered[0]["request_id"] != rendered[1]["request_id"]
    real = client.completions.create(model=model_name, prompt=ECHO_PROMPT, max_tokens=1,
                                     extra_body={"prompt_logprobs": 0})
    assert engine_prompt_ids(real.model_dump()["choices"][0]["prompt_logprobs"]) == first["token_ids"][1:]
    assert real.usage.prompt_tokens == len(first["token_ids"])
    by_ids = httpx.post(f"{server.url}/v1/completions/render", json={"prompt": [504, 2988, 314]}).json()
    assert [r["token_ids"] for r in by_ids] == [[504, 2988, 314]]


def test_chat_render_matches_the_engines_prompt(server, client, model_name):
    messages = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "Name a primary color."}]
    resp = httpx.post(f"{server.url}/v1/chat/completions/render", json={"messages": messages}, timeout=30)
    assert resp.status_code == 200, resp.text
    rendered = resp.json()
    assert set(rendered) == GENERATE_REQUEST_KEYS and rendered["model"] == model_name
    ids = rendered["token_ids"]
    # No max_tokens: the rest of the context, as the engine resolves it.
    max_model_len = client.models.list().data[0].model_dump()["max_model_len"]
    assert rendered["sampling_params"]["max_tokens"] == max_model_len - len(ids)
    real = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert engine_prompt_ids(real.model_dump()["prompt_logprobs"]) == ids[1:]
    assert real.usage.prompt_tokens == len(ids)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "Name a primary color." in text and text.count("<|im_start|>") == 3   # system, user, assistant


@pytest.mark.parametrize("path,body,status", [
    ("/v1/completions/render", {"model": "nope", "prompt": "hi"}, 404),
    ("/v1/completions/render", {"prompt": [[10 ** 9]]}, 400),
    ("/v1/completions/render", {"prompt": "hi", "max_tokens": -1}, 400),
    ("/v1/completions/render", {"prompt": "word " * 3000}, 400),
    ("/v1/chat/completions/render", {"messages": []}, 400),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "hi"}], "n": 10 ** 6}, 400),
])
def test_render_refuses_what_the_real_endpoint_refuses(server, path, body, status):
    assert_openai_error(httpx.post(f"{server.url}{path}", json=body, timeout=30), status)
    real = path.removesuffix("/render")
    assert httpx.post(f"{server.url}{real}", json=body, timeout=30).status_code == status


def test_ready(server):
    resp = httpx.get(f"{server.url}/ready")
    assert resp.status_code == 200 and resp.json() == {"status": "ready"}
