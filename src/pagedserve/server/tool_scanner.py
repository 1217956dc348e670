"""Reads JSON tool calls out of a growing text: which call starts, its name, and the raw text of its arguments,
piece by piece. One scanner serves every JSON format; a CallSyntax says what sits between the call objects.

    <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call><tool_call>{...}</tool_call>
    ^ opening   ^ call 0 starts once its name is complete  ^^^^^^^^^^^^^^^^ arguments, as written
                                                                           ^ separator      closing ^

Between the objects whitespace is free. The arguments of a call are the model's own text, never re-serialized,
so streamed pieces and the finished message carry the same string; a call whose arguments are not valid JSON
makes the scan invalid, as does a name that is not one of the tools.
"""
from __future__ import annotations

import json

import regex
from dataclasses import dataclass, field

_MAX_HEAD_CHARS = 4096  # a head this long that still does not match is not a call


def call_head(*argument_keys: str) -> regex.Pattern:
    """The start of a call object up to its arguments value: {"name": "f", "arguments": (Llama 3.2 may put
    "type": "function" first)."""
    keys = "|".join(regex.escape(k) for k in argument_keys)
    return regex.compile(r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:'
                      + keys + r')"\s*:\s*')


@dataclass(frozen=True, slots=True)
class CallSyntax:
    openings: tuple[str, ...]    # before the first object (whitespace removed)
    separators: tuple[str, ...]  # between two objects
    closings: tuple[str, ...]    # after the last one; "" when nothing needs to follow
    head: regex.Pattern = call_head("arguments")  # group 1: the name, a JSON string or bare
    head_start: str = "{"   # the character a call starts with
    in_object: bool = True  # the arguments are followed by the "}" that closes the call object


# The array tool_choice="required" decodes (and Mistral writes after [TOOL_CALLS]).
ARRAY = CallSyntax(("[",), (",",), ("]",))


@dataclass(slots=True)
class CallEvent:
    index: int
    name: str | None = None  # set on the event that starts a call
    arguments: str = ""      # the next piece of the call's arguments text


def emit_arguments(arguments: list[str], piece: str, events: list[CallEvent]) -> None:
    # The last call's arguments text grows by `piece`; pieces of one call within one feed merge into one event.
    index = len(arguments) - 1
    arguments[index] += piece
    if events and events[-1].index == index:
        events[-1].arguments += piece
    else:
        events.append(CallEvent(index, arguments=piece))


@dataclass(slots=True)
class CallScanner:
    syntax: CallSyntax = ARRAY
    known_names: set[str] | None = None  # None: any name (the grammar already chose among the tools)
    state: str = "gap"  # gap -> head -> arguments -> tail -> gap ... ; "done" and "invalid" end it
    gap: str = ""       # the text since the last object, whitespace removed
    head: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False  # the arguments value has begun
    names: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return bool(self.names) and (self.state == "done" or self.state == "gap" and self.gap in self.syntax.closings)

    @property
    def invalid(self) -> bool:
        return self.state == "invalid"

    def feed(self, text: str) -> list[CallEvent]:
        events: list[CallEvent] = []
        for ch in text:
            if self.state in ("done", "invalid"):
                break
            self._step(ch, events)
        return events

    def _step(self, ch: str, events: list[CallEvent]) -> None:
        if self.state == "gap":
            self._gap_char(ch)
        elif self.state == "head":
            self.head += ch
            # A head that can no longer become one (a JSON answer such as {"answer": 42}) ends the scan at once.
            m = self.syntax.head.fullmatch(self.head, partial=True)
            if m is None:
                self.state = "invalid"
            elif not m.partial and not ch.isspace():
                name = json.loads(m.group(1)) if m.group(1).startswith('"') else m.group(1)
                if self.known_names is not None and name not in self.known_names:
                    self.state = "invalid"
                    return
                self.names.append(name)
                self.arguments.append("")
                events.append(CallEvent(len(self.names) - 1, name=name))
                self.state, self.depth, self.in_string, self.escaped, self.started = "arguments", 0, False, False, False
            elif len(self.head) > _MAX_HEAD_CHARS:
                self.state = "invalid"
        elif self.state == "arguments":
            self._argument_char(ch, events)
        elif self.state == "tail":
            if ch == "}":
                self.state, self.gap = "gap", ""
            elif not ch.isspace():
                self.state = "invalid"

    def _gap_char(self, ch: str) -> None:
        if ch.isspace():
            return
        before_call = self.syntax.separators if self.names else self.syntax.openings
        if ch == self.syntax.head_start and self.gap in before_call:
            self.state, self.head = "head", ch
            return
        gap = self.gap + ch
        if any(s.startswith(gap) for s in before_call) or self.names and any(
                s.startswith(gap) for s in self.syntax.closings):
            self.gap = gap
        elif self.names and self.gap in self.syntax.closings:
            self.state = "done"  # what follows the calls is not part of them
        else:
            self.state = "invalid"

    def _argument_char(self, ch: str, events: list[CallEvent]) -> None:
        if not self.started:
            if ch.isspace():
                return
            self.started = True
        elif not self.in_string and self.depth == 0 and ch in ",} \n\t\r":
            # The end of a scalar value (number, true, false, null): ch belongs to the call object.
            self._end_arguments()
            if self.state != "invalid":
                self._step(ch, events)
            return
        emit_arguments(self.arguments, ch, events)
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 0:
                    self._end_arguments()
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self._end_arguments()

    def _end_arguments(self) -> None:
        try:
            json.loads(self.arguments[-1])
        except ValueError:
            self.state = "invalid"
            return
        self.state, self.gap = ("tail", "") if self.syntax.in_object else ("gap", "")

