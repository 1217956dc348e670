"""Tool-call and reasoning parsers on the text each model family writes, whole and streamed in pieces."""
from __future__ import annotations

import json
import re

import pytest

from pagedserve.server.cli_args import REASONING_PARSERS, TOOL_CALL_PARSERS
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.reasoning import REASONING_PARSERS as REASONING_CLASSES
from pagedserve.server.tool_parsers import TOOL_PARSERS, make_tool_parser
from pagedserve.server.tool_stream import ChoiceStreamer, final_message

NAMES = {"get_weather", "get_time"}
CHUNK_SIZES = (1, 3, 7, 10_000)

# (parser, text as the family's model writes it after its chat template's tool prompt, content, calls)
SAMPLES = [
    # Qwen2.5 / Qwen3 (hermes): the template asks for one <tool_call></tool_call> block per call.
    ("hermes", 'I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
               '{"timezone": "Europe/Paris"}}\n</tool_call>',
     "I will look both up.", [("get_weather", {"city": "Paris", "unit": "celsius"}),
                              ("get_time", {"timezone": "Europe/Paris"})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "S\\u00e3o Paulo", "days": [1, 2]}}\n'
               '</tool_call>', None, [("get_weather", {"city": "São Paulo", "days": [1, 2]})]),
    # Llama 3.1 / 3.2 JSON tool calling: {"name": ..., "parameters": ...}; <|python_tag|> when special tokens stay.
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("llama3_json", '{"type": "function", "name": "get_time", "parameters": {"timezone": "UTC"}}',
     None, [("get_time", {"timezone": "UTC"})]),  # as Llama 3.2 1B / 3B often write it
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {"timezone": "CET"}}',
     None, [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "CET"})]),
    # Mistral 7B v0.3 / Nemo / Small (tokenizer v3-v7): [TOOL_CALLS] and a JSON array.
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]',
     None, [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]),
    ("mistral", 'Let me check. [TOOL_CALLS] [{"name": "get_time", "arguments": {}}]',
     "Let me check.", [("get_time", {})]),
    # Mistral Small 3.2 / Magistral / Devstral (tokenizer v11+): name[ARGS]arguments per call.
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{}',
     None, [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]),
    # Llama 3.2 (pythonic, as its template's tool prompt asks) and Llama 4 (with its python tags kept).
    ("pythonic", '[get_weather(city="Paris", unit=\'celsius\', days=[1, 2], hourly=True), get_time()]',
     None, [("get_weather", {"city": "Paris", "unit": "celsius", "days": [1, 2], "hourly": True}),
            ("get_time", {})]),
    ("pythonic", '<|python_start|>[get_time(timezone="Europe/Paris, CET", offset=-1.5, extra=None)]'
                 '<|python_end|>', None, [("get_time", {"timezone": "Europe/Paris, CET", "offset": -1.5,
                                                        "extra": None})]),
    # Phi-4-mini
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     None, [("get_weather", {"city": "Paris"})]),
]

LAST_TEXT = {parser_name: text for parser_name, text, _, _ in SAMPLES}  # the last sample of each parser

# Text that opens like calls but is not: it stays content, whole and streamed.
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),
    ("hermes", 'Use <tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>'),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"]'),
    ("mistral", '[TOOL_CALLS]unknown_tool[ARGS]{}'),
    ("pythonic", '[1, 2, 3] are numbers'),
    ("pythonic", '[get_weather("Paris")]'),
    ("pythonic", '[get_weather(city=open("x"))]'),
    ("pythonic", '[get_weather(city="Paris")] and more'),
    ("phi4_mini_json", 'functools[{"name": "get_weather"}]'),
]


def stream(parser_name: str, text: str, size: int) -> tuple[str, list[tuple[str, str, str]], bool]:
    parser = make_tool_parser(parser_name, NAMES)
    content, calls = "", {}
    for i in range(0, len(text), size):
        delta = parser.feed(text[i:i + size])
        content += delta.content
        for e in delta.events:
            if e.name is not None:
                assert e.index == len(calls)
                calls[e.index] = [parser.call_ids[e.index], e.name, ""]
            calls[e.index][2] += e.arguments
    rest, complete = parser.finish()
    return content + rest.content, [tuple(c) for c in calls.values()], complete


@pytest.mark.parametrize("parser_name, text, content, calls", SAMPLES)
def test_family_format_whole_and_streamed(parser_name, text, content, calls):
    whole = make_tool_parser(parser_name, NAMES).extract(text)
    assert whole.content == content
    assert [(name, json.loads(arguments)) for _, name, arguments in whole.calls] == calls
    for size in CHUNK_SIZES:
        streamed_content, streamed_calls, complete = stream(parser_name, text, size)
        assert complete and (streamed_content or None) == whole.content, size
        assert [c[1:] for c in streamed_calls] == [c[1:] for c in whole.calls], size


@pytest.mark.parametrize("parser_name, text", MALFORMED)
def test_malformed_calls_stay_text(parser_name, text):
    whole = make_tool_parser(parser_name, NAMES).extract(text)
    assert whole.content == text and whole.calls == []
    for size in CHUNK_SIZES:
        content, calls, complete = stream(parser_name, text, size)
        assert not complete and content == text, size


def test_plain_answers_stream_unchanged_and_ids_follow_the_family():
    text = "  The weather in Paris is [sunny] and {warm}.\n"
    for name in TOOL_PARSERS:
        for size in CHUNK_SIZES:
            assert stream(name, text, size) == (text, [], False)
    # A JSON answer is content as soon as its first key shows it is not a call (not held to the end).
    assert make_tool_parser("llama3_json", NAMES).feed('{"answer": ').content == '{"answer": '
    for call_id, _, _ in make_tool_parser("mistral", NAMES).extract(LAST_TEXT["mistral"]).calls:
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call_id)  # Mistral's templates refuse any other id
    assert make_tool_parser("hermes", NAMES).extract(SAMPLES[0][1]).calls[0][0].startswith("call_")
    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS) and set(REASONING_PARSERS) == set(REASONING_CLASSES)


# (parser, enable_thinking, text, reasoning, content)
REASONING = [
    # DeepSeek-R1: the template ends the prompt with "<think>\n", the model writes the rest of the thought.
    ("deepseek_r1", True, "The user asks for 2+2.\nThat is 4.\n</think>\n\n2 + 2 = 4.",
     "The user asks for 2+2.\nThat is 4.\n", "2 + 2 = 4."),
    ("deepseek_r1", True, "<think>\nShort.\n</think>\n\nYes.", "\nShort.\n", "Yes."),
    ("deepseek_r1", True, "Still thinking when cut", "Still thinking when cut", ""),
    # Qwen3: thinking mode opens with <think>; the non-thinking answer has no tags.
    ("qwen3", True, "<think>\nParis is the capital.\n</think>\n\nParis.", "\nParis is the capital.\n", "Paris."),
    ("qwen3", True, "Paris. Note: </think> is a tag.", None, "Paris. Note: </think> is a tag."),
    ("qwen3", False, "<think>\nnot a thought\n</think>\n\nParis.", None, "<think>\nnot a thought\n</think>\n\nParis."),
    ("deepseek_r1", False, "Paris.", None, "Paris."),
]


@pytest.mark.parametrize("parser_name, thinking, text, reasoning, content", REASONING)
def test_reasoning_whole_and_streamed(parser_name, thinking, text, reasoning, content):
    assert REASONING_CLASSES[parser_name](thinking).extract(text) == (reasoning, content)
    for size in CHUNK_SIZES:
        parser = REASONING_CLASSES[parser_name](thinking)
        pieces = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
        assert ("".join(r for r, _ in pieces) or None, "".join(c for _, c in pieces)) == (reasoning, content)


TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in sorted(NAMES)]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("parser_name, reasoning_parser, text", [
    ("hermes", "qwen3", "<think>\nThe user wants Paris.\n</think>\n\n" + SAMPLES[0][1]),
    ("llama3_json", None, LAST_TEXT["llama3_json"]),
    ("mistral", None, LAST_TEXT["mistral"]),
    ("pythonic", None, LAST_TEXT["pythonic"]),
    ("phi4_mini_json", "deepseek_r1", "Paris it is.</think>" + LAST_TEXT["phi4_mini_json"]),
])
def test_chat_deltas_join_to_the_message(parser_name, reasoning_parser, text):
    # What the chat endpoint streams (OpenAI deltas: id, type and name first, then arguments) and answers.
    req = ChatCompletionRequest(messages=ASK, tools=TOOLS)
    message, finish = final_message(req, text, "stop", parser_name, reasoning_parser)
    assert finish == "tool_calls"
    for size in (1, 7):
        streamer = ChoiceStreamer(req, parser_name, reasoning_parser)
        reasoning, content, calls, last_finish, num_call_deltas = "", "", {}, None, 0
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            delta, last_finish = streamer.delta(piece, "stop" if i == len(pieces) - 1 else None)
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
            for d in delta.tool_calls or ():
                num_call_deltas += 1
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = [d.id, d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index][2] += d.function.arguments or ""
        assert last_finish == "tool_calls"
        assert (reasoning or None, content or None) == (message.reasoning_content, message.content)
        assert [tuple(c[1:]) for c in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert num_call_deltas > len(message.tool_calls)  # not sent whole at the end


def test_chat_template_kwargs_and_documents_reach_the_template():
    # The in-process app on the fake engine with a template that counts the documents and reads enable_thinking
    # (the fake tokenizer knows the words t0..t99), and raises without documents.
    from pagedserve.config import ModelConfig
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from tests.server.fake_engine import FakeCore
    from tests.server.test_hardening import call

    template = ("{% if not documents %}{{ raise_exception('this template needs documents') }}{% endif %}"
                "{% for d in documents %}t{{ loop.index }} {% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}t9 t9 t9{% endif %}")
    engine = FakeCore()
    engine.config.model = ModelConfig(chat_template=template)
    async_engine = AsyncLLMEngine(engine)
    docs = [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}]
    body = {"messages": ASK, "max_tokens": 2}
    try:
        responses = call(async_engine, [
            ("POST", "/v1/chat/completions", {"json": {**body, "documents": docs}}),
            ("POST", "/v1/chat/completions", {"json": {**body, "documents": docs,
                                                       "chat_template_kwargs": {"enable_thinking": False}}}),
            ("POST", "/v1/chat/completions", {"json": body}),
            ("POST", "/v1/chat/completions", {"json": {**body, "stream": True}}),
            ("POST", "/v1/chat/completions", {"json": {**body, "chat_template_kwargs": {"tools": []}}}),
        ])
    finally:
        async_engine.shutdown()
    assert [r.status_code for r in responses] == [200, 200, 400, 400, 400], [r.text for r in responses]
    assert [r.json()["usage"]["prompt_tokens"] for r in responses[:2]] == [2, 5]
    for r in responses[2:4]:
        assert "this template needs documents" in r.json()["error"]["message"]
    assert "chat_template_kwargs must not set tools" in responses[4].json()["error"]["message"]
