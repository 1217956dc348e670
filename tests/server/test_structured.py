"""Structured outputs and tool calling over HTTP with the official openai client."""
from __future__ import annotations

import concurrent.futures
import json
import re
import time

import httpx
import jsonschema
import openai
import pytest

from tests.server.helpers import ServerProcess
from tests.structured_output.test_offline import pathological_schema

# Generous: on a loaded 2-core machine the (low-priority) compile threads can take seconds for a tools schema.
COMPILE_TIMEOUT_S = 20
VISITORS = {"type": "function", "function": {
    "name": "get_visitors", "description": "Visitors of one store on one day, per hour",
    "parameters": {"type": "object", "properties": {
        "store": {"type": "integer", "minimum": 1, "maximum": 999},
        "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
        "per": {"enum": ["hour", "day"]}}, "required": ["store", "date", "per"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}
TOOLS = [VISITORS, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "How many visitors did store 12 have on 2026-03-04, per hour?"}]


@pytest.fixture(scope="module")
def tool_server():
    srv = ServerProcess("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                        "--structured-outputs-compile-timeout", str(COMPILE_TIMEOUT_S))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def oai(tool_server):
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


# Every token under a grammar writes at least one character, and the longest valid call is under 160 characters
# (the longest: get_weather with 12 \\uXXXX-escaped characters), so no answer can be cut off by max_tokens.
MAX_TOKENS = 160


def _check_calls(choices) -> int:
    num = 0
    for choice in choices:
        assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message)
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            num += 1
    return num


def test_required_and_named_arguments_validate_100_of_100(oai, model):
    named = {"type": "function", "function": {"name": "get_visitors"}}
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=MAX_TOKENS, n=50)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        required = pool.submit(oai.chat.completions.create, tool_choice="required", parallel_tool_calls=False,
                               seed=1, **kwargs)
        by_name = pool.submit(oai.chat.completions.create, tool_choice=named, seed=2, **kwargs)
        required, by_name = required.result(), by_name.result()
    assert _check_calls(required.choices) == 50
    assert _check_calls(by_name.choices) == 50
    assert {c.message.tool_calls[0].function.name for c in by_name.choices} == {"get_visitors"}


def _assemble(stream) -> tuple[dict[int, list[tuple[str, str]]], int]:
    # The calls of each choice, and how many chunks carried argument pieces (streamed, not sent whole).
    calls: dict[int, dict[int, dict]] = {}
    finish = {}
    num_argument_chunks = 0
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
            for d in choice.delta.tool_calls or ():
                entry = calls.setdefault(choice.index, {}).get(d.index)
                if entry is None:  # OpenAI's first delta of a call: index, id, type and the whole name
                    assert d.id.startswith("call_") and d.type == "function" and d.function.name, d
                    entry = calls[choice.index][d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and not d.function.name, d
                    num_argument_chunks += 1
                entry["arguments"] += d.function.arguments or ""
    assert set(finish.values()) == {"tool_calls"}
    return {i: [(c["name"], c["arguments"]) for _, c in sorted(v.items())] for i, v in calls.items()}, \
        num_argument_chunks


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_assemble_to_the_non_streamed_ones(oai, model, tool_choice):
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=7, n=3,
                  max_tokens=MAX_TOKENS, parallel_tool_calls=False)
    whole = oai.chat.completions.create(**kwargs)
    _check_calls(whole.choices)
    expected = {c.index: [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
                for c in whole.choices}
    streamed, num_argument_chunks = _assemble(oai.chat.completions.create(stream=True, **kwargs))
    assert streamed == expected
    assert num_argument_chunks > 3 * len(expected)  # the arguments arrive token by token


SLOTS = {"type": "function", "function": {
    "name": "book_slots", "description": "Book up to two hourly slots in a store",
    "parameters": {"type": "object", "$defs": {
        "hour": {"type": "integer", "minimum": 8, "maximum": 20},
        "slot": {"type": "object", "properties": {"hour": {"$ref": "#/$defs/hour"}, "staff": {"enum": ["a", "b"]}},
                 "required": ["hour", "staff"]}},
        "properties": {"store": {"type": "integer", "minimum": 1, "maximum": 99},
                       "slots": {"type": "array", "items": {"$ref": "#/$defs/slot"}, "minItems": 1, "maxItems": 2},
                       "backup": {"$ref": "#/properties/slots/items"}},
        "required": ["store", "slots", "backup"]}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "book_slots"}}])
def test_tool_parameters_with_refs_and_defs(oai, model, tool_choice):
    # Under "required" the tools' schemas sit inside an array of calls, so their "#/..." references must be
    # moved along with them (server/tool_calls.py); a named tool's schema is the root and resolves as given.
    # Under "required" book_slots is the only tool, so every call goes through its moved references (next to
    # get_visitors the model picked it in 4 of 96 samples).
    tools = [SLOTS] if tool_choice == "required" else [VISITORS, SLOTS]
    out = oai.chat.completions.create(model=model, messages=ASK, tools=tools, tool_choice=tool_choice,
                                      temperature=1.0, seed=5, n=4, max_tokens=MAX_TOKENS,
                                      parallel_tool_calls=False)
    schemas = {**SCHEMAS, "book_slots": SLOTS["function"]["parameters"]}
    names = set()
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message)
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            names.add(call.function.name)
    assert "book_slots" in names


def test_tool_history_renders_and_auto_answers(oai, model):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_visitors", "arguments": '{"store": 12, "date": "2026-03-04", "per": "hour"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"09": 31, "10": 48}'}]
    tokens = httpx.post(f"{oai.base_url}".replace("/v1/", "") + "/tokenize",
                        json={"messages": history}, timeout=60).json()["tokens"]
    assert len(tokens) > 40
    out = oai.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert none.choices[0].message.tool_calls in (None, [])


def test_response_format_and_structured_outputs(oai, model):
    schema = {"type": "object", "properties": {"store": {"type": "integer", "minimum": 1, "maximum": 50},
                                               "busy": {"type": "boolean"}}, "required": ["store", "busy"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "store", "schema": schema, "strict": True}}
    chat = oai.chat.completions.create(model=model, messages=ASK, response_format=fmt, max_tokens=40, n=4,
                                       temperature=1.0, seed=3)
    for c in chat.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)
    obj = oai.chat.completions.create(model=model, messages=ASK, response_format={"type": "json_object"},
                                      max_tokens=40, temperature=0)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    comp = oai.completions.create(model=model, prompt="Store 12 is", max_tokens=20,
                                  extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(comp.choices[0].text), schema)
    choice = oai.completions.create(model=model, prompt="Pick:", max_tokens=5, n=3, temperature=1.0,
                                    extra_body={"structured_outputs": {"choice": ["hour", "day"]}})
    assert {c.text for c in choice.choices} <= {"hour", "day"}
    regex = oai.chat.completions.create(model=model, messages=ASK, max_tokens=12, stream=True,
                                        extra_body={"structured_outputs": {"regex": "2026-0[1-9]-[0-2][0-9]"}})
    text = "".join(ch.choices[0].delta.content or "" for ch in regex if ch.choices)
    assert len(text) == 10 and text.startswith("2026-0")


def _tool_with(**function: object) -> dict:
    return {"type": "function", "function": {**WEATHER["function"], **function}}


def _called(**function: str) -> list[dict]:
    call = {"name": "get_weather", "arguments": '{"city": "Rome"}', **function}
    return ASK + [{"role": "assistant", "content": None,
                   "tool_calls": [{"id": "call_1", "type": "function", "function": call}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}},
     "'uniqueItems' at #/properties/a"),
    ({"structured_outputs": {"regex": "a(b"}}, "regex cannot be compiled"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    # A lone surrogate anywhere in a tool or an earlier tool call (the tokenizer cannot encode it).
    ({"tools": [_tool_with(description="a\ud800")]}, "surrogate"),
    ({"tools": [_tool_with(parameters={"type": "object", "properties": {"\ud800": {"type": "string"}}})]},
     "surrogate"),
    ({"tools": [_tool_with(parameters={"type": "object", "properties": {"p": {"enum": ["\ud800"]}}})]},
     "surrogate"),
    ({"messages": _called(name="get_\ud800")}, "surrogate"),
    ({"messages": _called(arguments='{"a": "\ud800"}')}, "surrogate"),
    # Schemas nested past any real use: a JSON string 5,000 deep, an object 150 deep.
    ({"structured_outputs": {"json": '{"items":' * 5000 + "{}" + "}" * 5000}}, "nested too deeply"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(150)}}},
     "nested more than 100"),
    # Constraints that no token could satisfy.
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "matches no text"),
    ({"structured_outputs": {"grammar": "root ::= [^\\x00-\\U0010FFFF]"}}, "matches no text"),  # empty language
    ({"structured_outputs": {"choice": ["yes", "no"]}, "min_tokens": 4}, "min_tokens"),
    ({"structured_outputs": {"choice": ["yes", "no"]}, "allowed_token_ids": [28]}, "allowed_token_ids"),
    # ... or none from some point on: four digits, then only the end, which min_tokens forbids.
    ({"structured_outputs": {"regex": "20[0-9][0-9]"}, "min_tokens": 12, "max_tokens": 16}, "no token satisfies both"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "not both"),
])
def test_bad_input_is_a_400(tool_server, body, message):
    # json.dumps writes a lone surrogate as \ud800, as a careless client would; httpx's encoder refuses it.
    r = httpx.post(f"{tool_server.url}/v1/chat/completions", timeout=60, headers={"Content-Type": "application/json"},
                   content=json.dumps({"messages": ASK, "max_tokens": 4, **body}).encode())
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_the_connection_serves_on_after_400s(tool_server):
    # These were 500s, after which the client's next request on the same connection was reset.
    with httpx.Client(base_url=tool_server.url, timeout=60, headers={"Content-Type": "application/json"}) as http:
        for path, body in (("/v1/chat/completions", {"structured_outputs": {"regex": "[^\\s\\S]"}}),
                           ("/v1/chat/completions", {"tools": [_tool_with(description="\ud800")]}),
                           ("/v1/completions", {"prompt": [-1], "echo": True})):
            resp = http.post(path, content=json.dumps({"messages": ASK, "max_tokens": 2, **body}).encode())
            assert resp.status_code == 400, resp.text
        # A constraint that runs dry mid-stream ends the stream with the request's error, not a server error.
        dry = {"messages": ASK, "max_tokens": 16, "stream": True, "min_tokens": 12,
               "structured_outputs": {"regex": "20[0-9][0-9]"}}
        with http.stream("POST", "/v1/chat/completions", content=json.dumps(dry).encode()) as resp:
            events = [line for line in resp.iter_lines() if line]
        assert events[-1] == "data: [DONE]" and "no token satisfies both" in events[-2], events[-3:]
        assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "invalid_request_error"
        ok = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_legacy_guided_fields(oai, model):
    # vLLM's older names, as older clients still send them, constrain the output as structured_outputs does.
    choice = oai.completions.create(model=model, prompt="Pick:", max_tokens=5, n=3, temperature=1.0, seed=4,
                                    extra_body={"guided_choice": ["hour", "day"]})
    assert {c.text for c in choice.choices} <= {"hour", "day"}
    regex = oai.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=1.0, seed=5,
                                        extra_body={"guided_regex": "2026-0[1-9]-[0-2][0-9]",
                                                    "guided_decoding_backend": "xgrammar"})
    assert re.fullmatch("2026-0[1-9]-[0-2][0-9]", regex.choices[0].message.content)
    schema = SCHEMAS["get_weather"]
    as_json = oai.chat.completions.create(model=model, messages=ASK, max_tokens=MAX_TOKENS, temperature=1.0, seed=6,
                                          extra_body={"guided_json": json.dumps(schema)})
    assert as_json.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(as_json.choices[0].message.content), schema)
    grammar = oai.completions.create(model=model, prompt="Say:", max_tokens=8, temperature=1.0, seed=7,
                                     extra_body={"guided_grammar": 'root ::= "ab" | "cd"'})
    assert grammar.choices[0].text in ("ab", "cd")


def test_required_call_array_streams_pieces_that_join_to_the_whole():
    import random

    from pagedserve.server.tool_parsers import RequiredToolParser

    calls = [{"name": "get_weather", "arguments": {"city": "q\\\"}]{,", "x": [1, {"z": None}]}},
             {"name": "get_visitors", "arguments": {}}, {"name": "n\u00e9", "arguments": 5}]
    names = {c["name"] for c in calls}
    text = json.dumps(calls, ensure_ascii=False)
    whole = [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
    assert [(n, a) for _, n, a in RequiredToolParser(names).extract(text).calls] == whole
    for bad in (text[:-2], "[]", '{"a": 1}'):
        assert RequiredToolParser(names).extract(bad).calls == []
    rng = random.Random(0)
    for _ in range(20):  # any cut of the text into pieces gives the same calls, names first
        parser, got, i = RequiredToolParser(names), {}, 0
        while i < len(text):
            piece = text[i:i + rng.randint(1, 6)]
            i += len(piece)
            for e in parser.feed(piece).events:
                if e.name is not None:
                    assert e.index == len(got)
                    got[e.index] = [e.name, ""]
                got[e.index][1] += e.arguments
        assert parser.finish()[1]
        assert [tuple(v) for v in got.values()] == whole


def test_live_auto_tool_call_and_reasoning_stream_as_deltas(oai, model):
    # The embedded model does not call tools by itself: a choice grammar makes it write what Qwen3 writes
    # (server/tool_calls.py leaves structured_outputs alone under "auto"), so the server's reading is tested.
    text = ('<think>\nRome is in Italy.\n</think>\n\nChecking.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=MAX_TOKENS,
                  extra_body={"structured_outputs": {"choice": [text]}})
    whole = oai.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.reasoning_content == "\nRome is in Italy.\n" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and (call.function.name, call.function.arguments) == \
        ("get_weather", '{"city": "Rome"}')
    chunks = list(oai.chat.completions.create(stream=True, **kwargs))
    calls, _ = _assemble(chunks)
    reasoning, content, chunks_before_finish = "", "", 0
    for c in chunks:
        delta = c.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        if delta.tool_calls and not c.choices[0].finish_reason:
            chunks_before_finish += 1
    assert reasoning == choice.message.reasoning_content and content == choice.message.content
    assert calls == {0: [("get_weather", '{"city": "Rome"}')]}
    assert chunks_before_finish > 3  # name first, then argument pieces, before the finish


def test_pathological_schema_is_refused_within_the_timeout_while_others_flow(tool_server, oai, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": pathological_schema(8)}}

    def pathological() -> tuple[int, float]:
        t0 = time.monotonic()
        r = httpx.post(f"{tool_server.url}/v1/chat/completions", timeout=120,
                       json={"messages": ASK, "max_tokens": 4, "response_format": fmt})
        return r.status_code, time.monotonic() - t0, r.json()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bad = pool.submit(pathological)
        time.sleep(0.2)
        t0 = time.monotonic()
        plain = oai.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0)
        plain_s = time.monotonic() - t0
        status, seconds, body = bad.result()
    assert status == 400 and "did not compile within" in body["error"]["message"], body
    assert COMPILE_TIMEOUT_S <= seconds < COMPILE_TIMEOUT_S + 10
    assert plain.choices[0].finish_reason in ("stop", "length") and plain_s < COMPILE_TIMEOUT_S + 10
