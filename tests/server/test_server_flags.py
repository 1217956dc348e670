"""A server with --max-samples-per-request, a --chat-template that refuses tool messages,
--disable-debug-routes and the start-up warm-up; a double signal."""
from __future__ import annotations

import os
import re
import signal
import tempfile
import time

import httpx
import openai
import pytest

from pagedserve.server.app import FORCED_EXIT_CODE
from pagedserve.engine.warmup import warmup_requests
from tests.server.helpers import MAX_MODEL_LEN, ServerProcess, metric, scrape
from tests.server.test_errors import assert_openai_error

MAX_SAMPLES = 4
VOCAB_SIZE = 49152  # the embedded model's
# Longer than the test's stream takes to finish by itself: only the second signal can end it with an error.
DRAIN_S = 600
# ChatML, as the embedded model's own template, plus a raise_exception as real templates use for bad roles.
TEMPLATE = """{%- for m in messages -%}
{%- if m['role'] == 'tool' -%}{{ raise_exception('tool messages are not supported') }}{%- endif -%}
<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""


@pytest.fixture(scope="module")
def flag_server():
    with tempfile.NamedTemporaryFile("w", suffix=".jinja", delete=False) as f:
        f.write(TEMPLATE)
    srv = ServerProcess("--max-samples-per-request", str(MAX_SAMPLES), "--chat-template", f.name,
                        "--disable-debug-routes", "--shutdown-timeout", str(DRAIN_S), "--warmup")
    srv.metrics_at_start = scrape(srv.url)  # before any test's request
    yield srv
    srv.close()
    os.unlink(f.name)


@pytest.fixture(scope="module")
def flag_client(flag_server):
    return openai.OpenAI(base_url=f"{flag_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_samples_per_request_are_capped(flag_client):
    hi = [{"role": "user", "content": "hi"}]
    for kwargs, param in ((dict(n=MAX_SAMPLES + 1), "n"), (dict(n=1, extra_body={"best_of": 10 ** 7}), "best_of")):
        with pytest.raises(openai.BadRequestError) as e:
            flag_client.completions.create(model=None, prompt="hi", max_tokens=1, **kwargs)
        assert e.value.body["param"] == param and str(MAX_SAMPLES) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        flag_client.chat.completions.create(model="x", messages=hi, n=10 ** 7, max_tokens=1)
    assert e.value.body["param"] == "n"
    out = flag_client.completions.create(model=None, prompt="hi", max_tokens=1, n=MAX_SAMPLES, seed=3)
    assert len(out.choices) == MAX_SAMPLES


def test_start_up_log_gives_model_and_prefaulted_pool(flag_server):
    # The pool (--kv-cache-memory 96 MiB: 2,176 tokens x 46,080 B = 95 MiB) is resident from the start.
    line = re.search(r"memory: model and runtime (\d+) MiB \+ KV pool (\d+) MiB \(resident from the start\) = "
                     r"(\d+) MiB resident", flag_server.read_log())
    assert line, flag_server.read_log()
    model, pool, rss = map(int, line.groups())
    assert pool == 2176 * 46080 >> 20
    assert model + pool == rss and model > 100


def test_warm_up_ends_before_the_memory_line_and_before_listening(flag_server):
    # The warm-up's one-time memory (oneDNN, allocator arenas, code paged in, grammar tables) is in the start-up
    # figure, and /ready cannot answer before it ends: the server binds its port only after it.
    log = flag_server.read_log().splitlines()
    where = {key: next((i for i, line in enumerate(log) if key in line), None)
             for key in ("warm-up: 11 requests", "memory: model and runtime", "Uvicorn running on")}
    assert None not in where.values(), (where, log)
    assert where["warm-up: 11 requests"] < where["memory: model and runtime"] < where["Uvicorn running on"]
    assert not [line for line in log if "warm-up failed" in line]  # the chat and the schema ran too


def test_the_warm_up_leaves_no_trace(flag_server):
    # Its blocks left the prefix cache and its requests and tokens the counters: a server starts from zero.
    series = flag_server.metrics_at_start
    for name in ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "num_preemptions_total", "kv_cache_usage_perc"):
        assert metric(series, f"pagedserve:{name}") == 0, name
    assert sum(v for (name, _), v in series.items() if name == "pagedserve:request_success_total") == 0
    # The warm-up's long prompt again: a hit would be its blocks left in the cache.
    [[(_, prompt_ids, _)], *_] = warmup_requests(VOCAB_SIZE, MAX_MODEL_LEN)
    before = metric(scrape(flag_server.url), "pagedserve:prefix_cache_hits_total")
    resp = httpx.post(f"{flag_server.url}/v1/completions", json={"prompt": prompt_ids, "max_tokens": 1}, timeout=60)
    assert resp.status_code == 200, resp.text
    after = scrape(flag_server.url)
    assert metric(after, "pagedserve:prefix_cache_hits_total") == before
    assert metric(after, "pagedserve:prefix_cache_queries_total") >= len(prompt_ids)


def test_debug_routes_can_be_disabled(flag_server):
    for path in ("/debug/kv", "/dashboard", "/dashboard/app.js", "/dashboard/login"):
        resp = httpx.get(f"{flag_server.url}{path}", timeout=10)
        assert resp.status_code == 404, path
    assert httpx.get(f"{flag_server.url}/health", timeout=10).status_code == 200


def test_template_raise_exception_is_400(flag_server, flag_client):
    conv = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            flag_client.chat.completions.create(model=None, messages=conv, max_tokens=2, stream=stream)
        assert "tool messages are not supported" in e.value.body["message"]
    resp = httpx.post(f"{flag_server.url}/tokenize", json={"messages": conv}, timeout=30)
    assert "tool messages are not supported" in assert_openai_error(resp, 400)["message"]
    # The template still serves everything else.
    ok = flag_client.chat.completions.create(model=None, messages=conv[:1], max_tokens=2, temperature=0.0)
    assert ok.choices[0].message.content


def test_second_signal_ends_streams_properly_and_exits_nonzero(flag_server):
    # Runs last in this module: the server is gone afterwards.
    body = {"prompt": "Tell a story", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{flag_server.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(line for line in lines if line)
        flag_server.proc.send_signal(signal.SIGINT)  # drain: the stream may go on for DRAIN_S
        time.sleep(0.5)
        flag_server.proc.send_signal(signal.SIGINT)  # stop now, but end the stream with an error and [DONE]
        rest = [line for line in lines if line]
    rc = flag_server.proc.wait(30)
    # The drain outlasts the stream's 1,000 tokens: left to it, the stream would end with finish_reason
    # "length" and no error event.
    assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2], rest[-3:]
    assert rc == FORCED_EXIT_CODE, flag_server.read_log()
    assert "stopped by a second signal" in flag_server.read_log()
