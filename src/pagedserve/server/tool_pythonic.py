"""Python-style tool calls (Llama 3.2 and Llama 4 write them): a list of calls with keyword arguments.

    [get_weather(city="Rome", days=2), get_time()]

Arguments must be literals (ast.literal_eval); each call's arguments become a JSON object. The whole text is
read with Python's own parser; a stream is read one argument at a time: a call's first piece carries its name,
then each keyword argument goes out once its value is complete, as JSON text that joins to json.dumps of the
whole dict: '{"city": "Rome"' ', "days": 2' '}'.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

from pagedserve.server.tool_scanner import CallEvent, emit_arguments

# Llama 4 wraps the list in these when special tokens are kept in the text.
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_OPEN = re.compile(r"\s*(?:<\|python_start\|>)?\s*\[")
_AFTER_CALL = re.compile(r"\s*[,\]]")
_NAME = re.compile(r"\s*([A-Za-z_]\w*)\s*\(")
_KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=")
_PARTIAL_NAME = re.compile(r"\s*\w*\s*")  # what may still grow into a name or a keyword
_CLOSERS = {")": "(", "]": "[", "}": "{"}


def _json_value(value_text: str) -> str | None:
    try:
        return json.dumps(ast.literal_eval(value_text.strip()), ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def parse_pythonic(text: str, known_names: set[str]) -> list[tuple[str, str]] | None:
    """(name, arguments as JSON text) of each call, or None when text is not a list of calls to known tools."""
    text = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END)
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in known_names
                and not node.args and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, TypeError, RecursionError):
            return None
    return calls


@dataclass(slots=True)
class PythonicScanner:
    """The stream counterpart of parse_pythonic, with CallScanner's interface."""
    known_names: set[str]
    state: str = "open"  # open -> call -> arguments <-> value; -> after_call -> call ... -> done; or invalid
    text: str = ""
    pos: int = 0         # text[:pos] is read
    names: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)
    keywords: set[str] = field(default_factory=set)  # of the current call
    keyword: str = ""  # the one whose value is being read

    @property
    def complete(self) -> bool:
        return self.state == "done"

    @property
    def invalid(self) -> bool:
        return self.state == "invalid"

    def feed(self, text: str) -> list[CallEvent]:
        self.text += text
        events: list[CallEvent] = []
        while self._advance(events):
            pass
        return events

    def _advance(self, events: list[CallEvent]) -> bool:
        """Reads one more token if the text holds all of it; False when it must wait (or the scan is over)."""
        rest = self.text[self.pos:]
        if self.state == "invalid":
            return False
        if self.state == "done":
            if not PYTHON_END.startswith("".join(rest.split())):
                self.state = "invalid"
            return False
        if self.state in ("open", "after_call"):
            m = (_OPEN if self.state == "open" else _AFTER_CALL).match(rest)
            if m is None:
                compact = "".join(rest.split())
                if compact and (self.state == "after_call" or not (PYTHON_START + "[").startswith(compact)):
                    self.state = "invalid"
                return False
            self.pos += m.end()
            self.state = "done" if m.group(0).endswith("]") else "call"
            return True
        if self.state == "call":
            m = _NAME.match(rest)
            if m is None:
                return self._wait_for_name(rest)
            if m.group(1) not in self.known_names:
                return self._fail()
            self.names.append(m.group(1))
            self.arguments.append("")
            self.keywords = set()
            events.append(CallEvent(len(self.names) - 1, name=m.group(1)))
            self.pos += m.end()
            self.state = "arguments"
            return True
        if self.state == "arguments":
            stripped = rest.lstrip()
            if stripped.startswith(")"):
                emit_arguments(self.arguments, "}" if self.arguments[-1] else "{}", events)
                self.pos += len(rest) - len(stripped) + 1
                self.state = "after_call"
                return True
            m = _KEYWORD.match(rest)
            if m is None:
                return self._wait_for_name(rest)
            if m.group(1) in self.keywords:
                return self._fail()
            self.keywords.add(m.group(1))
            self.keyword = m.group(1)
            self.pos += m.end()
            self.state = "value"
            return True
        # value: up to the next "," or ")" outside brackets and strings
        end = _value_end(rest)
        if end is None:
            return False
        value = _json_value(rest[:end])
        if value is None:
            return self._fail()
        opener = ", " if self.arguments[-1] else "{"
        emit_arguments(self.arguments, f"{opener}{json.dumps(self.keyword, ensure_ascii=False)}: {value}", events)
        self.pos += end + (rest[end] == ",")
        self.state = "arguments"
        return True

    def _wait_for_name(self, rest: str) -> bool:
        # Waits (False) while rest may still become a name; otherwise the scan is invalid.
        if _PARTIAL_NAME.fullmatch(rest) is None:
            self.state = "invalid"
        return False

    def _fail(self) -> bool:
        self.state = "invalid"
        return False


def _value_end(text: str) -> int | None:
    """Where a Python literal that starts text ends (at a top-level "," or ")"); None if not yet written."""
    stack: list[str] = []
    quote: str | None = None
    escaped = False
    for i, ch in enumerate(text):
        if quote is not None:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in _CLOSERS:
            if not stack or stack.pop() != _CLOSERS[ch]:
                return i  # a ")" that ends the call, or unbalanced text that literal_eval refuses
        elif ch == "," and not stack:
            return i
    return None
