"""A server with --max-samples-per-request, a --chat-template that refuses tool messages and
--disable-debug-routes; a double signal."""
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
from tests.server.helpers import ServerProcess
from tests.server.test_errors import assert_openai_error

MAX_SAMPLES = 4
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
                        "--disable-debug-routes", "--shutdown-timeout", str(DRAIN_S))
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
