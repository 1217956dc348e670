"""Tool-call parsers for tool_choice "auto", by vLLM's --tool-call-parser names, and the one for "required".

Each family writes calls its own way after (or instead of) some content:

    hermes          Qwen 2.5 / Qwen 3 / Hermes   text <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    llama3_json     Llama 3.1 / 3.2 (JSON)       <|python_tag|>{"name": ..., "parameters": {...}}; {...}
                                                 (the tag is optional; without it the message starts with "{")
    mistral         Mistral (tokenizer < v11)    text [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
                    Mistral (tokenizer >= v11)   text [TOOL_CALLS]get_weather[ARGS]{...}[TOOL_CALLS]...
    pythonic        Llama 3.2 / Llama 4          [get_weather(city="Rome"), ...]   (server/tool_pythonic.py)
    phi4_mini_json  Phi-4-mini                   functools[{"name": ..., "arguments": {...}}, ...]

Gemma 2 / 3 chat templates define no tool-call format, and neither does Phi-3's. Phi-4-mini's template only
carries the tool list (<|tool|>...<|/tool|>); functools[...] is the call format vLLM's phi4_mini_json reads.

A parser reads one choice: feed() takes the text as it comes and returns content (streamed until a call may
be starting; a partial marker and trailing whitespace are held back) and call events (a call's name, then
pieces of its arguments); finish() ends it. extract() reads a whole text. Calls that turn out malformed, or
name no known tool, leave the text as content.
"""
from __future__ import annotations

import random
import string
import uuid
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import regex

from pagedserve.server.markers import marker_prefix_len
from pagedserve.server.tool_pythonic import PYTHON_START, PythonicScanner, parse_pythonic
from pagedserve.server.tool_scanner import ARRAY, CallEvent, CallScanner, CallSyntax, call_head


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class Scanner(Protocol):
    names: list[str]
    arguments: list[str]

    @property
    def complete(self) -> bool: ...

    @property
    def invalid(self) -> bool: ...

    def feed(self, text: str) -> list[CallEvent]: ...


@dataclass(slots=True)
class ExtractedCalls:
    content: str | None
    calls: list[tuple[str, str, str]]  # (id, name, arguments JSON text)


@dataclass(slots=True)
class ToolDelta:
    content: str = ""
    events: list[CallEvent] = field(default_factory=list)


class ToolParser:
    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()  # open the calls wherever they appear
    bare_openings: ClassVar[str] = ""        # characters that open the calls when the message starts with them

    def __init__(self, tool_names: set[str]) -> None:
        self.tool_names = tool_names
        self.state = "content"  # content -> calls; calls -> text when they turn out not to be calls
        self.held = ""          # content not sent yet, or the calls' text so far
        self.sent_content = False
        self.scanner: Scanner | None = None
        self.call_ids: list[str] = []

    def new_scanner(self) -> Scanner:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return new_call_id()

    def feed(self, text: str) -> ToolDelta:
        if self.state == "text":
            return ToolDelta(content=text)
        self.held += text
        if self.state == "content":
            start = self._calls_start()
            if start is None:
                keep = self._num_held_back()
                return ToolDelta(content=self._send(len(self.held) - keep))
            # The whitespace before the calls goes with them (it is content again if they are not calls).
            content = self._send(len(self.held[:start].rstrip()))
            self.state, self.scanner = "calls", self.new_scanner()
            return self._scan(self.held, content)
        return self._scan(text, "")

    def finish(self) -> tuple[ToolDelta, bool]:
        """What is left, and whether the calls are complete (the choice then finishes with "tool_calls")."""
        if self.state == "calls" and self.scanner.complete:
            return ToolDelta(), True
        held, self.held = self.held, ""
        return ToolDelta(content=held), False

    def extract(self, text: str) -> ExtractedCalls:
        delta = self.feed(text)
        _, complete = self.finish()
        if not complete:
            return ExtractedCalls(text, [])
        return ExtractedCalls(delta.content or None, self._calls())

    def _calls(self) -> list[tuple[str, str, str]]:
        return list(zip(self.call_ids, self.scanner.names, self.scanner.arguments))

    def _scan(self, text: str, content: str) -> ToolDelta:
        events = self.scanner.feed(text)
        if self.scanner.invalid:
            # Not calls after all: their text is content (the events of a call already sent stand).
            self.state = "text"
            return ToolDelta(content=content + self._send(len(self.held)))
        self.call_ids += [self.new_call_id() for e in events if e.name is not None]
        return ToolDelta(content, events)

    def _calls_start(self) -> int | None:
        if not self.sent_content and self.bare_openings:
            stripped = self.held.lstrip()
            if stripped and stripped[0] in self.bare_openings:
                return len(self.held) - len(stripped)
        found = [i for i in (self.held.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def _num_held_back(self) -> int:
        # A marker may be starting at the end; whitespace before a marker is not content.
        keep = max((marker_prefix_len(self.held, marker) for marker in self.markers), default=0)
        before = self.held[:len(self.held) - keep]
        keep += len(before) - len(before.rstrip())
        if not self.sent_content and self.bare_openings and not self.held.strip():
            keep = len(self.held)  # only whitespace so far: the message may still open with a call
        return keep

    def _send(self, num_chars: int) -> str:
        content, self.held = self.held[:num_chars], self.held[num_chars:]
        self.sent_content = self.sent_content or bool(content.strip())
        return content


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    TOOL_PARSERS[cls.name] = cls
    return cls


def make_tool_parser(name: str, tool_names: set[str]) -> ToolParser:
    return TOOL_PARSERS[name](tool_names)


class _JsonToolParser(ToolParser):
    syntax: ClassVar[CallSyntax]

    def new_scanner(self) -> Scanner:
        return CallScanner(self.syntax, self.tool_names)


@register
class HermesToolParser(_JsonToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    syntax = CallSyntax(("<tool_call>",), ("</tool_call><tool_call>",), ("</tool_call>", ""))


@register
class Llama3JsonToolParser(_JsonToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>",)
    bare_openings = "{"
    syntax = CallSyntax(("<|python_tag|>", ""), (";", ""), ("", ";"),
                        call_head("parameters", "arguments"))


# Mistral's tokenizers before v11 write [TOOL_CALLS] and a JSON array; v11 and later (Mistral Small 3.2,
# Magistral, Devstral) write [TOOL_CALLS]name[ARGS]{arguments} per call.
_MISTRAL_ARRAY = CallSyntax(("[TOOL_CALLS][",), ARRAY.separators, ARRAY.closings)
_MISTRAL_V11 = CallSyntax(("",), ("",), ("",), regex.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]"),
                          head_start="[", in_object=False)


@dataclass(slots=True)
class _MistralScanner:
    """Reads whichever of the two formats the text turns out to be (the character after [TOOL_CALLS] tells)."""
    known_names: set[str]
    text: str = ""
    inner: CallScanner | None = None

    @property
    def names(self) -> list[str]:
        return [] if self.inner is None else self.inner.names

    @property
    def arguments(self) -> list[str]:
        return [] if self.inner is None else self.inner.arguments

    @property
    def complete(self) -> bool:
        return self.inner is not None and self.inner.complete

    @property
    def invalid(self) -> bool:
        return self.inner is not None and self.inner.invalid

    def feed(self, text: str) -> list[CallEvent]:
        if self.inner is not None:
            return self.inner.feed(text)
        self.text += text
        after = self.text.lstrip()[len("[TOOL_CALLS]"):].lstrip()
        if not after:
            return []
        self.inner = CallScanner(_MISTRAL_ARRAY if after[0] == "[" else _MISTRAL_V11, self.known_names)
        return self.inner.feed(self.text)


@register
class MistralToolParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def new_scanner(self) -> Scanner:
        return _MistralScanner(self.tool_names)

    def new_call_id(self) -> str:
        # Mistral's chat templates accept only 9-character alphanumeric tool call ids.
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))


@register
class Phi4MiniJsonToolParser(_JsonToolParser):
    name = "phi4_mini_json"
    markers = ("functools[",)
    syntax = CallSyntax(("functools[",), ARRAY.separators, ARRAY.closings)


@register
class PythonicToolParser(ToolParser):
    name = "pythonic"
    markers = (PYTHON_START,)
    bare_openings = "["

    def new_scanner(self) -> Scanner:
        return PythonicScanner(self.tool_names)

    def extract(self, text: str) -> ExtractedCalls:
        # Python's own parser reads the whole text; the stream's scanner must agree with it (tested).
        start = max(text.find(PYTHON_START), 0)
        content, calls_text = text[:start].rstrip(), text[start:]
        calls = parse_pythonic(calls_text, self.tool_names)
        if calls is None:
            return ExtractedCalls(text, [])
        return ExtractedCalls(content or None, [(self.new_call_id(), n, a) for n, a in calls])


class RequiredToolParser(_JsonToolParser):
    """tool_choice "required": the grammar makes the whole message a JSON array of calls."""
    bare_openings = "["
    syntax = ARRAY
