"""The HTTP app in-process against the fake engine: health heartbeat, error bodies, API keys, body limit."""
from __future__ import annotations

import asyncio
import http.client
import json
import re
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from pagedserve.cli import build_parser
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.server.app import build_app
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.streaming import SSE_DONE, SSEResponse
from tests.server.fake_engine import PROMPT, FakeCore
from tests.server.test_errors import assert_openai_error

KEY = "k-123"


@pytest.fixture
def fake():
    engine = FakeCore()
    async_engine = AsyncLLMEngine(engine)
    yield engine, async_engine
    if engine.step_gate is not None:
        engine.step_gate.set()
    async_engine.shutdown()


def call(async_engine: AsyncLLMEngine, requests, **args) -> list[httpx.Response]:
    """Send (method, path, kwargs) requests in order to a fresh app; returns the responses."""
    app = build_app(async_engine, SimpleNamespace(**args))

    async def main():
        # raise_app_exceptions=False: Starlette re-raises an unhandled error after answering (a server logs it).
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as client:
            return [await client.request(method, path, **kw) for method, path, kw in requests]

    return asyncio.run(main())


def test_health_follows_the_step_heartbeat(fake):
    engine, async_engine = fake
    engine.step_gate = threading.Event()
    app = build_app(async_engine, SimpleNamespace(health_max_stall_s=0.1))

    async def main():
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as client:
            before = await client.get("/health")
            stream = await async_engine.add_request("r", PROMPT, SamplingParams(max_tokens=2))
            await asyncio.sleep(0.3)  # the step is stuck on the gate
            stuck = await client.get("/health")
            engine.step_gate.set()
            [o async for o in stream]
            after = await client.get("/health")
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)
            stopped = await client.get("/health")
            return before, stuck, after, stopped

    before, stuck, after, stopped = asyncio.run(asyncio.wait_for(main(), 10))
    assert before.status_code == 200 and after.status_code == 200
    assert assert_openai_error(stuck, 503)["type"] == "service_unavailable"
    assert_openai_error(stopped, 503)


def test_health_follows_the_tokenizer_thread(fake):
    # Every request is tokenized on a tokenizer thread: a job stuck there stalls everyone as a stuck step does.
    _, async_engine = fake
    app = build_app(async_engine, SimpleNamespace(health_max_stall_s=0.1))
    gate = threading.Event()

    async def main():
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as client:
            stuck_job = asyncio.ensure_future(async_engine._on_tokenizer_thread(
                async_engine._tokenizer, lambda proc: gate.wait(10)))
            await asyncio.sleep(0.3)
            stuck = await client.get("/health")
            gate.set()
            await stuck_job
            return stuck, await client.get("/health")

    stuck, after = asyncio.run(asyncio.wait_for(main(), 10))
    assert "tokenizer" in assert_openai_error(stuck, 503)["message"]
    assert after.status_code == 200


def test_unhandled_error_is_an_openai_500(fake):
    _, async_engine = fake
    [resp] = call(async_engine, [("POST", "/v1/completions", {"json": {"prompt": "crash", "max_tokens": 2}})])
    err = assert_openai_error(resp, 500)
    assert err["type"] == "server_error" and "RuntimeError" in err["message"]


def test_the_connection_serves_on_after_a_500(fake):
    # uvicorn closed the connection when Starlette re-raised a bug's error after its 500: the client's next
    # request on the keep-alive connection was reset. One socket: the 500, then a completion, then /metrics.
    _, async_engine = fake
    server = uvicorn.Server(uvicorn.Config(build_app(async_engine, SimpleNamespace()), host="127.0.0.1", port=0,
                                           log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        answers = []
        for method, path, body in (("POST", "/v1/completions", {"prompt": "crash", "max_tokens": 2}),
                                   ("POST", "/v1/completions", {"prompt": "t1 t2", "max_tokens": 2}),
                                   ("GET", "/metrics", None)):
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            answers.append((resp.status, resp.read().decode()))
            if len(answers) == 1:
                first_socket = conn.sock
        assert conn.sock is first_socket  # never reopened
        conn.close()
    finally:
        server.should_exit = True
        thread.join(10)
    assert [status for status, _ in answers] == [500, 200, 200]
    assert "RuntimeError" in json.loads(answers[0][1])["error"]["message"]
    # The 500 passed the response counter (it was answered outside it before).
    assert re.search(r'http_requests_total\{handler="/v1/completions",method="POST",status="5xx"\} 1\.0', answers[2][1])


def test_a_stream_that_breaks_still_ends_with_an_error_event_and_done():
    async def body():
        yield "data: {}\n\n"
        raise RuntimeError("bug after the first event")

    sent: list[dict] = []
    closed = []

    async def receive():
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    response = SSEResponse(body(), on_close=lambda: closed.append(True))
    asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[0] == "data: {}" and '"error"' in events[1] and "bug after" in events[1]
    assert events[-1] + "\n\n" == SSE_DONE and closed == [True]


def test_bearer_scheme_is_case_insensitive(fake):
    _, async_engine = fake
    headers = [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY}", f"Bearer {KEY}x", f"Basic {KEY}", KEY, "bearer"]
    resps = call(async_engine, [("GET", "/v1/models", {"headers": {"Authorization": h}}) for h in headers],
                 api_key=KEY)
    assert [r.status_code for r in resps] == [200, 200, 200, 401, 401, 401, 401]


def test_empty_api_key_is_refused(fake):
    _, async_engine = fake
    with pytest.raises(ValueError, match="api-key"):
        build_app(async_engine, SimpleNamespace(api_key=""))
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--api-key", ""])
    assert e.value.code == 2


def test_body_size_limit(fake):
    _, async_engine = fake
    limit = 1000
    big = {"prompt": "t1 " * 700, "max_tokens": 2}

    async def chunks():  # no Content-Length: a chunked upload, refused once it passes the limit
        for _ in range(10):
            yield b" " * 300
        yield b'{"prompt": "t1 t2", "max_tokens": 2}'

    resps = call(async_engine, [("POST", "/v1/completions", {"json": big}),
                                ("POST", "/v1/completions", {"content": chunks(),
                                                             "headers": {"Content-Type": "application/json"}}),
                                ("POST", "/v1/completions", {"json": {"prompt": "t1 t2", "max_tokens": 2}})],
                 max_request_body_size=limit)
    for resp in resps[:2]:
        err = assert_openai_error(resp, 413)
        assert "max-request-body-size" in err["message"]
    assert resps[2].status_code == 200 and resps[2].json()["choices"][0]["finish_reason"] == "length"
    # The default limit lets a 2000-byte body through.
    assert call(async_engine, [("POST", "/v1/completions", {"json": big})])[0].status_code == 200


def test_sample_cap(fake):
    _, async_engine = fake
    resps = call(async_engine, [
        ("POST", "/v1/completions", {"json": {"prompt": "t1 t2", "n": 5, "max_tokens": 2}}),
        ("POST", "/v1/completions", {"json": {"prompt": "t1 t2", "n": 1, "best_of": 5, "max_tokens": 2}}),
        ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "hi"}], "n": 5}}),
    ], max_samples_per_request=4)
    assert [assert_openai_error(r, 400)["param"] for r in resps] == ["n", "best_of", "n"]


def test_sequence_and_token_caps(fake):
    _, async_engine = fake
    chat = [{"role": "user", "content": "t1"}]
    resps = call(async_engine, [
        ("POST", "/v1/completions", {"json": {"prompt": ["t1"] * 5, "n": 2, "max_tokens": 2}}),
        ("POST", "/v1/completions", {"json": {"prompt": [[1], [2], [3]], "n": 1, "best_of": 3, "max_tokens": 2}}),
        ("POST", "/v1/completions", {"json": {"prompt": ["t1 t2"] * 3, "max_tokens": 40}}),
        ("POST", "/v1/completions", {"json": {"prompt": [[1, 2]] * 2, "n": 2, "max_tokens": 40}}),
        ("POST", "/v1/chat/completions", {"json": {"messages": chat, "max_tokens": 200}}),
        ("POST", "/v1/completions", {"json": {"prompt": ["t1 t2"] * 2, "n": 2, "max_tokens": 20}}),
    ], max_sequences_per_request=8, max_tokens_per_request=100)
    for resp in resps[:2]:
        assert "--max-sequences-per-request" in assert_openai_error(resp, 400)["message"]
    for resp in resps[2:5]:
        assert "--max-tokens-per-request" in assert_openai_error(resp, 400)["message"]
    assert len(resps[5].json()["choices"]) == 4  # 2 x (2 + 2 x 20) = 84 tokens, 4 sequences: within both


def test_default_caps_refuse_a_small_body_that_would_queue_64000_sequences(fake):
    engine, async_engine = fake
    [resp] = call(async_engine, [("POST", "/v1/completions", {"json": {"prompt": ["t1"] * 1000, "n": 64}})])
    assert "--max-sequences-per-request" in assert_openai_error(resp, 400)["message"]
    assert not engine.requests and not engine.batches  # nothing reached the engine
    # Without max_tokens a prompt may take the rest of the context: 64 samples of one prompt fit the default
    # token cap (max_samples x max_model_len), two such prompts do not.
    [resp] = call(async_engine, [("POST", "/v1/completions", {"json": {"prompt": [[1] * 10] * 2, "n": 64,
                                                                       "max_tokens": None}})],
                  max_sequences_per_request=128)
    assert "--max-tokens-per-request" in assert_openai_error(resp, 400)["message"]


def test_huge_chats_are_refused_before_tokenizing(fake):
    engine, async_engine = fake
    limit_chars = engine.max_model_len * 5  # the longest word of the fake vocabulary, "[UNK]", has 5
    part = "t1 " * (limit_chars // 3 // 2)  # each part alone is within the bound, three together are not
    messages = [{"role": "user", "content": part}, {"role": "assistant", "content": part},
                {"role": "user", "content": part}]
    tool = {"type": "function", "function": {"name": "f", "description": part * 3, "parameters": {}}}
    hi = [{"role": "user", "content": "t1"}]
    # Refused before the template renders them (a 15 MB chat or tool through Jinja), not only once the rendered
    # text is measured: the renderer is never called.
    renders = []
    tokenizer = async_engine.processor.tokenizer
    render = tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda *a, **kw: renders.append(1) or render(*a, **kw)
    resps = call(async_engine, [
        ("POST", "/v1/chat/completions", {"json": {"messages": messages, "max_tokens": 2}}),
        ("POST", "/v1/chat/completions", {"json": {"messages": hi, "tools": [tool], "tool_choice": "none",
                                                   "max_tokens": 2}}),
        ("POST", "/tokenize", {"json": {"messages": messages}}),
    ])
    for resp in resps:
        assert "characters" in assert_openai_error(resp, 400)["message"]
    assert not renders and not engine.requests
