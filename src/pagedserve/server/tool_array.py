"""Reads the array of calls that tool_choice="required" decodes, as it grows: which call starts, its name, and
the raw text of its arguments, piece by piece.

    [{"name": "get_visitors", "arguments": {"store": 12, "per": "hour"}}, {"name": ...}]
      ^ call 0 starts once its name is complete   ^^^^^^^^^^^^^^^^^^^^^^ arguments, streamed as written

The grammar fixes the shape (key order "name", "arguments"; no free whitespace), so a small scanner over the
characters is enough. The arguments of a call are the model's own text, never re-serialized: streamed pieces
and the finished message carry the same string.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_MAX_HEAD_CHARS = 4096  # a head this long that still does not match is not a call


@dataclass(slots=True)
class CallEvent:
    index: int
    name: str | None = None  # set on the event that starts a call
    arguments: str = ""      # the next piece of the call's arguments text


@dataclass(slots=True)
class CallArrayScanner:
    state: str = "array"  # array -> head -> arguments -> tail -> array ... -> done; "invalid" ends it
    head: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False  # the arguments value has begun
    names: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.state == "done"

    def feed(self, text: str) -> list[CallEvent]:
        events: list[CallEvent] = []
        for ch in text:
            self._step(ch, events)
        return events

    def _step(self, ch: str, events: list[CallEvent]) -> None:
        if self.state == "array":
            if ch == "{":
                self.state, self.head = "head", ch
            elif ch == "]":
                self.state = "done"
            elif ch not in "[, \n\t\r":
                self.state = "invalid"
        elif self.state == "head":
            self.head += ch
            m = _HEAD.fullmatch(self.head)
            if m is not None and not ch.isspace():
                self.names.append(json.loads(m.group(1)))
                self.arguments.append("")
                events.append(CallEvent(len(self.names) - 1, name=self.names[-1]))
                self.state, self.depth, self.in_string, self.escaped, self.started = "arguments", 0, False, False, False
            elif len(self.head) > _MAX_HEAD_CHARS:
                self.state = "invalid"
        elif self.state == "arguments":
            self._argument_char(ch, events)
        elif self.state == "tail":
            if ch == "}":
                self.state = "array"
            elif not ch.isspace():
                self.state = "invalid"

    def _argument_char(self, ch: str, events: list[CallEvent]) -> None:
        if not self.started:
            if ch.isspace():
                return
            self.started = True
        elif not self.in_string and self.depth == 0 and ch in ",} \n\t\r":
            # The end of a scalar value (number, true, false, null): ch belongs to the call object.
            self.state = "tail"
            self._step(ch, events)
            return
        self._emit(ch, events)
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 0:
                    self.state = "tail"
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.state = "tail"

    def _emit(self, ch: str, events: list[CallEvent]) -> None:
        index = len(self.names) - 1
        self.arguments[index] += ch
        if events and events[-1].index == index and events[-1].name is None:
            events[-1].arguments += ch
        else:
            events.append(CallEvent(index, arguments=ch))


def split_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments text) of each call in a complete array; None when text is not one."""
    scanner = CallArrayScanner()
    scanner.feed(text)
    if not scanner.complete or not scanner.names or text[text.rindex("]") + 1:].strip():
        return None
    return list(zip(scanner.names, scanner.arguments))
