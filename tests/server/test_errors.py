"""Error bodies and status codes, API keys, the small endpoints, and the vLLM-compatible switches."""
from __future__ import annotations

import json
import signal
import threading

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY
from tests.server.helpers import MAX_MODEL_LEN, metric, scrape

ERROR_KEYS = {"message", "type", "param", "code"}


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["message"]
    return body["error"]


def post(server, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=60, **kw)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "temperature": -1}, None),
    ({"prompt": "hi", "top_p": 0}, None),
    ({"prompt": "hi", "max_tokens": 0}, None),
    ({"prompt": "hi", "n": 2, "temperature": 0}, None),          # n > 1 needs sampling
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),      # pydantic type errors are 400, not 422
    ({"prompt": "hi", "logprobs": 99}, "logprobs"),
    ({"prompt": []}, None),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": [-5]}, None),                                    # token id outside the vocabulary
    ({"prompt": [-1], "echo": True}, None),                      # ... checked before echo decodes it
    ({"prompt": [[5], [10 ** 30]], "echo": True}, None),
    ({"max_tokens": 3}, "prompt"),                               # missing prompt
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, None),  # stream_options without stream
])
def test_invalid_completion_fields_are_400(server, body, param):
    err = assert_openai_error(post(server, "/v1/completions", json=body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def post_raw(server, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800 (httpx's own encoder cannot encode it at all).
    return post(server, path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


SURROGATE = "a\ud800b"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": SURROGATE, "max_tokens": 2}),
    ("/v1/completions", {"prompt": ["fine", SURROGATE], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "stop": [SURROGATE], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}],
                              "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "model": SURROGATE}),
    ("/tokenize", {"prompt": SURROGATE}),
    ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}),
    ("/tokenize", {"messages": [{"role": SURROGATE, "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {SURROGATE: 1}}),
])
def test_lone_surrogates_are_400(server, path, body):
    assert_openai_error(post_raw(server, path, body), 400)


@pytest.mark.parametrize("fields,param", [
    # json.dumps writes Infinity and NaN, which Python's JSON parser (the server's) reads back.
    ({"temperature": float("inf")}, "temperature"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"top_p": float("nan")}, "top_p"),
    ({"seed": 2 ** 64}, "seed"),
    ({"seed": -2 ** 63 - 1}, "seed"),
    ({"seed": 2 ** 64 - 1, "n": 2}, None),  # sample 1 would use seed + 1
])
def test_values_that_would_fail_inside_a_step_are_400(server, fields, param):
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        err = assert_openai_error(post_raw(server, path, {**body, "max_tokens": 2, **fields}), 400)
        if param is not None:
            assert err["param"] == param


def test_invalid_chat_fields_are_400(server):
    assert_openai_error(post(server, "/v1/chat/completions", json={"messages": []}), 400)
    assert_openai_error(post(server, "/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}), 400)
    assert_openai_error(post(server, "/v1/chat/completions",
                             json={"messages": [{"content": "no role"}]}), 400)


def test_malformed_json_is_400(server):
    for raw in (b"{not json", b"", b"[1, 2"):
        resp = post(server, "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert_openai_error(resp, 400)


def test_prompt_longer_than_context_is_400(server, client, model_name):
    long_ids = [28] * (MAX_MODEL_LEN + 10)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=long_ids, max_tokens=4)
    assert e.value.status_code == 400
    assert "max_model_len" in e.value.body["message"] or "context" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt="hi", max_tokens=MAX_MODEL_LEN)
    with pytest.raises(openai.BadRequestError):  # streaming requests fail before the stream starts
        client.completions.create(model=model_name, prompt=long_ids, max_tokens=4, stream=True)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "x " * 2100}],
                                       max_tokens=4)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])


def test_unknown_route_and_method(server):
    assert_openai_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    assert_openai_error(httpx.get(f"{server.url}/v1/completions"), 405)


def test_bad_requests_do_not_disturb_requests_in_flight(server, client, model_name):
    stream = client.completions.create(model=model_name, prompt="Count slowly:", max_tokens=30, temperature=0.0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    errors = []

    def hammer():
        for body in ({"prompt": "x", "temperature": -3}, {"prompt": [10 ** 9]}, {"prompt": [1] * 5000},
                     {"prompt": "x", "seed": 2 ** 64 - 1, "n": 2}, {"prompt": "x", "seed": 2 ** 64}):
            errors.append(post(server, "/v1/completions", json=body).status_code)
        errors.append(post_raw(server, "/v1/completions", {"prompt": SURROGATE}).status_code)
        errors.append(post(server, "/v1/completions", content=b"{{{",
                           headers={"Content-Type": "application/json"}).status_code)

    t = threading.Thread(target=hammer)
    t.start()
    rest = list(chunks)
    t.join()
    assert errors == [400] * 7
    usage = rest[-1].usage
    assert usage.completion_tokens == 30
    assert [c.choices[0].finish_reason for c in [first, *rest] if c.choices][-1] == "length"


def test_models_health_version(server, client, model_name):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert models[0].model_dump()["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_tokenize_detokenize(server, model_name):
    resp = post(server, "/tokenize", json={"model": model_name, "prompt": "Hello world"})
    body = resp.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == MAX_MODEL_LEN
    back = post(server, "/detokenize", json={"model": model_name, "tokens": body["tokens"]}).json()
    assert back["prompt"] == "Hello world"
    chat = post(server, "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > body["count"]
    assert_openai_error(post(server, "/detokenize", json={"tokens": [-1]}), 400)
    assert_openai_error(post(server, "/tokenize", json={"model": "nope", "prompt": "x"}), 404)


def test_metrics_exposed_with_vllm_names(server, model_name):
    s = scrape(server.url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total"):
        metric(s, f"pagedserve:{name}", model_name=model_name)
    assert metric(s, "pagedserve:request_success_total", model_name=model_name, finished_reason="length") > 0
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert metric(s, f"pagedserve:{name}_count", model_name=model_name) > 0
        assert metric(s, f"pagedserve:{name}_bucket", model_name=model_name, le="+Inf") > 0
    assert metric(s, "pagedserve:generation_tokens_total", model_name=model_name) > 0
    assert not any(n.startswith("vllm:") for n, _ in s)


def test_startup_log(server):
    log = server.read_log()
    assert "model: " in log
    assert "KV cache: " in log and " blocks x 16 tokens = " in log
    assert f"http://127.0.0.1:{server.port}" in log


# ---- a second server: API key, --served-model-name, --metrics-prefix vllm ----------------------------------

def test_api_key_required(keyed_server):
    base = f"{keyed_server.url}/v1"
    for key in ("wrong-key", API_KEY + "x", API_KEY[:-1]):
        bad = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="smol", prompt="hi", max_tokens=2)
    assert_openai_error(httpx.get(f"{base}/models"), 401)  # no key at all
    # A keyless request with a broken body is refused for the key, before its body is read.
    assert_openai_error(httpx.post(f"{base}/completions", content=b"{{"), 401)
    assert_openai_error(httpx.post(f"{keyed_server.url}/tokenize", json={"prompt": "x"}), 401)
    # Probes and scrapers stay open.
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200
    assert httpx.get(f"{keyed_server.url}/ready").status_code == 200
    assert httpx.get(f"{keyed_server.url}/metrics").status_code == 200

    good = openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == ["smol", "alias"]
    resp = good.completions.create(model="smol", prompt="Hello", max_tokens=3, temperature=0.0)
    assert resp.model == "smol" and resp.usage.completion_tokens >= 1
    resp = good.chat.completions.create(model="alias", messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=3, temperature=0.0, stream=True)
    assert any(c.choices and c.choices[0].delta.content for c in resp)
    with pytest.raises(openai.NotFoundError):
        good.completions.create(model="SmolLM2", prompt="Hello", max_tokens=3)


def test_metrics_prefix_vllm(keyed_server):
    good = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0)
    good.completions.create(model="smol", prompt="Hello", max_tokens=2, temperature=0.0)
    s = scrape(keyed_server.url)
    assert not any(n.startswith("pagedserve:") for n, _ in s)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count"):
        metric(s, f"vllm:{name}", model_name="smol")
    assert metric(s, "vllm:request_success_total", model_name="smol", finished_reason="length") >= 1


def test_sigterm_shuts_down_cleanly(keyed_server):
    # Runs last in this module (definition order): the keyed server is not used afterwards.
    stream = httpx.stream("POST", f"{keyed_server.url}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"prompt": "Tell a story", "max_tokens": 1000, "ignore_eos": True, "stream": True})
    with stream as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(lines)
        rc = keyed_server.stop(signal.SIGTERM, timeout=30)
        # After the drain period the open stream is ended by the server, with an error event and [DONE].
        rest = [line for line in lines if line]
    assert rc == 0, keyed_server.read_log()
    assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2], rest[-3:]
    log = keyed_server.read_log()
    assert "shut down cleanly" in log and "Traceback" not in log
