"""Each family's real chat template, rendered by the server, equals transformers' apply_chat_template.

The templates in chat_templates/ are the `chat_template` strings of the models' tokenizer_config.json: Qwen2.5,
Qwen3, Llama 3.1 / 3.2, Mistral (Nemo), Gemma 2, Phi-3.5 and Granite 3.3 (documents) as llama.cpp's
models/templates stores them (its scripts/get_chat_template.py, unchanged); Gemma 3 (google/gemma-3-4b-it) and
Phi-4-mini (microsoft/Phi-4-mini-instruct), which llama.cpp does not store, as two public copies of those
files agree on them. A conversation goes as an OpenAI client sends it (tool-call arguments as JSON text, no
content on a tool-calling turn) to /v1/chat/completions/render of the in-process app (fake engine, a byte-level
tokenizer, so that the prompt's ids decode to its exact text); transformers renders the same conversation with the
arguments as a dict, as its documentation writes them (as_documented), and the same tools, documents and template
variables. A template that raises answers 400 with its message.
"""
from __future__ import annotations

import copy
import json
import os

import pytest

from tests.server.fake_engine import FakeCore

TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
CALL = {"id": "call0A1b2", "type": "function",  # 9 alphanumerics: Mistral's template checks
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
# A tool call and its result, then the next question (as an OpenAI client sends them).
TOOL_TURNS = [{"role": "system", "content": "You are a weather bot."}, ASK,
              {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": CALL["id"], "content": "{\"temperature\": 21}"},
              {"role": "assistant", "content": "It is 21 degrees in Paris."},
              {"role": "user", "content": "And in Rome?"}]
CHAT = [{"role": "system", "content": "Answer briefly."}, ASK, {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "  And tomorrow?  "}]
NO_SYSTEM = CHAT[1:]
DOCS = [{"doc_id": 1, "title": "Paris", "text": "Paris is the capital of France."},
        {"doc_id": 2, "title": "Rome", "text": "Rome is the capital of Italy."}]

# family: (template file, bos, eos, request fields beyond messages)
CASES = {
    "qwen2.5-tools": ("Qwen-Qwen2.5-7B-Instruct", "<|endoftext|>", "<|im_end|>",
                      {"messages": TOOL_TURNS, "tools": [WEATHER]}),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct", "<|endoftext|>", "<|im_end|>", {"messages": NO_SYSTEM}),
    "qwen3-tools-no-thinking": ("Qwen-Qwen3-0.6B", "<|endoftext|>", "<|im_end|>",
                                {"messages": TOOL_TURNS, "tools": [WEATHER],
                                 "chat_template_kwargs": {"enable_thinking": False}}),
    "qwen3-thinking": ("Qwen-Qwen3-0.6B", "<|endoftext|>", "<|im_end|>",
                       {"messages": [ASK, {"role": "assistant", "content": "<think>\nHm.\n</think>\n\nSunny."},
                                     {"role": "user", "content": "And Rome?"}]}),
    "llama3.1-tools": ("meta-llama-Llama-3.1-8B-Instruct", "<|begin_of_text|>", "<|eot_id|>",
                       {"messages": TOOL_TURNS, "tools": [WEATHER]}),
    "llama3.2-tools": ("meta-llama-Llama-3.2-3B-Instruct", "<|begin_of_text|>", "<|eot_id|>",
                       {"messages": TOOL_TURNS, "tools": [WEATHER],
                        "chat_template_kwargs": {"date_string": "03 Dec 2026"}}),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct", "<|begin_of_text|>", "<|eot_id|>",
                 {"messages": CHAT, "chat_template_kwargs": {"date_string": "03 Dec 2026"}}),
    "mistral-tools": ("mistralai-Mistral-Nemo-Instruct-2407", "<s>", "</s>",
                      {"messages": TOOL_TURNS, "tools": [WEATHER]}),
    "gemma2": ("google-gemma-2-2b-it", "<bos>", "<eos>", {"messages": NO_SYSTEM}),
    "gemma3": ("google-gemma-3-4b-it", "<bos>", "<eos>", {"messages": CHAT}),
    "phi3.5": ("microsoft-Phi-3.5-mini-instruct", "<s>", "<|endoftext|>", {"messages": CHAT}),
    "phi4-mini": ("microsoft-Phi-4-mini-instruct", "<|endoftext|>", "<|endoftext|>", {"messages": CHAT}),
    "granite3.3-documents": ("ibm-granite-granite-3.3-2B-Instruct", "<|end_of_text|>", "<|end_of_text|>",
                             {"messages": NO_SYSTEM, "documents": DOCS, "tools": [WEATHER]}),
}


def byte_tokenizer(bos: str, eos: str):
    # Byte-level BPE without merges: every byte a token, so any text round-trips through its ids.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(sorted(bytes_to_unicode().values()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)


def render(template: str, tokenizer, requests: list[tuple[str, dict]]):
    # POST each (path, body) to an app whose model has this template and tokenizer.
    from pagedserve.config import ModelConfig
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from tests.server.test_hardening import call

    engine = FakeCore()
    engine.config.model = ModelConfig(chat_template=template)
    engine.loaded.tokenizer = tokenizer
    engine.loaded.hf_config.vocab_size = len(tokenizer)
    async_engine = AsyncLLMEngine(engine)
    try:  # a parser, so that tools with the default "auto" choice are accepted
        return call(async_engine, [("POST", path, {"json": body}) for path, body in requests],
                    enable_auto_tool_choice=True, tool_call_parser="hermes")
    finally:
        async_engine.shutdown()


def as_documented(messages: list[dict]) -> list[dict]:
    # The conversation as transformers' chat-template documentation writes it, a tool call's arguments as a dict;
    # content that a client leaves out (null) as empty text, as vLLM passes it (Qwen3's template reads every
    # turn's content).
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            for c in m["tool_calls"]:
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_family_template_renders_as_transformers(case: str) -> None:
    name, bos, eos, body = CASES[case]
    with open(os.path.join(TEMPLATES, f"{name}.jinja"), encoding="utf-8") as f:
        template = f.read()
    tokenizer = byte_tokenizer(bos, eos)
    [resp] = render(template, tokenizer, [("/v1/chat/completions/render", body)])
    assert resp.status_code == 200, resp.text
    kwargs = {k: body[k] for k in ("tools", "documents") if k in body} | body.get("chat_template_kwargs", {})
    want = tokenizer.apply_chat_template(as_documented(body["messages"]), chat_template=template, tokenize=False,
                                         add_generation_prompt=True, **kwargs)
    got = resp.json()["token_ids"]
    assert tokenizer.decode(got) == want
    assert got == tokenizer.encode(want, add_special_tokens=False)
    for part in ("Paris", *(["get_weather"] if "tools" in body and "granite" not in case else [])):
        assert part in want  # the conversation (and the tools) reached the prompt


def test_template_that_raises_is_400() -> None:
    # The templates' own raise_exception: Gemma 2 has no system role, Mistral's tool call ids are 9 characters,
    # its roles alternate. A 400 with the template's message, rendered alone or streamed.
    bad_id = copy.deepcopy(TOOL_TURNS)
    bad_id[2]["tool_calls"][0]["id"] = "call_1"
    bad_id[3]["tool_call_id"] = "call_1"
    cases = [("google-gemma-2-2b-it", {"messages": CHAT}, "System role not supported"),
             ("mistralai-Mistral-Nemo-Instruct-2407", {"messages": bad_id, "tools": [WEATHER]},
              "Tool call IDs should be alphanumeric strings with length 9!"),
             ("mistralai-Mistral-Nemo-Instruct-2407", {"messages": [ASK, ASK]},
              "conversation roles must alternate")]
    for name, body, message in cases:
        with open(os.path.join(TEMPLATES, f"{name}.jinja"), encoding="utf-8") as f:
            template = f.read()
        responses = render(template, byte_tokenizer("<s>", "</s>"), [
            ("/v1/chat/completions/render", body), ("/v1/chat/completions", {**body, "stream": True})])
        for resp in responses:
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert message in error["message"] and error["type"] == "invalid_request_error", error
