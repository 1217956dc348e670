"""Tool calls in chat responses: the final message of a choice, and its streamed deltas, as OpenAI sends them.

Streaming per tool_choice:
    named     the text is the call's arguments: a first delta with id, type and name, then arguments as they come
    required  the text is a JSON array of calls (server/tool_array.py): each call opens with a delta with id,
              type and name, then its arguments as they come
    auto      content streams until "<tool_call>" may be starting; from there the text is held and parsed at the end
A finish that cut the calls short (finish_reason "length") sends what was held as content (named and required
have sent their pieces already; the finish says "length").
"""
from __future__ import annotations

from pagedserve.server.protocol import (ChatCompletionRequest, ChatResponseMessage, DeltaFunctionCall,
                                        DeltaMessage, DeltaToolCall, FunctionCall, ToolCall)
from pagedserve.server.tool_array import CallArrayScanner
from pagedserve.server.tool_calls import HERMES_START, held_back, new_call_id, parse_tool_calls


def _tool_names(req: ChatCompletionRequest) -> set[str]:
    return {t.function.name for t in req.tools or ()}


def final_message(req: ChatCompletionRequest, text: str, finish_reason: str | None
                  ) -> tuple[ChatResponseMessage, str | None]:
    mode = req.tool_mode
    if mode == "none" or finish_reason == "length":
        return ChatResponseMessage(content=text), finish_reason
    if mode == "named":
        call = ToolCall(id=new_call_id(), function=FunctionCall(name=req.tool_choice.function.name, arguments=text))
        return ChatResponseMessage(content=None, tool_calls=[call]), "tool_calls"
    parsed = parse_tool_calls(mode, text, _tool_names(req))
    if not parsed.tool_calls:
        return ChatResponseMessage(content=text), finish_reason
    return ChatResponseMessage(content=parsed.content, tool_calls=parsed.tool_calls), "tool_calls"


class ToolStreamer:
    """Turns one choice's text deltas into DeltaMessages."""

    def __init__(self, req: ChatCompletionRequest) -> None:
        self.req = req
        self.mode = req.tool_mode
        self.held = ""        # text not sent yet
        self.in_calls = False  # auto: "<tool_call>" was seen, everything from there is held
        self.call_id: str | None = None  # named: the call's id once its first delta went out
        self.calls = CallArrayScanner()  # required: the calls read so far
        self.text = ""  # required: everything, sent as content if it never turns into a call

    def delta(self, text: str, finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
        if self.mode == "named":
            return self._named(text, finish_reason)
        if self.mode == "required":
            return self._required(text, finish_reason)
        self.held += text
        if finish_reason is not None:
            return self._finish(finish_reason)
        if not self.in_calls:  # auto
            start = self.held.find(HERMES_START)
            if start >= 0:
                self.in_calls = True
                content, self.held = self.held[:start], self.held[start:]
                return DeltaMessage(content=content or None), None
            keep = held_back(self.held)
            content = self.held[:len(self.held) - keep]
            self.held = self.held[len(self.held) - keep:]
            return DeltaMessage(content=content or None), None
        return DeltaMessage(), None

    def _named(self, text: str, finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
        if finish_reason == "length":
            finish = finish_reason
        else:
            finish = "tool_calls" if finish_reason is not None else None
        if self.call_id is None:
            self.call_id = new_call_id()
            call = DeltaToolCall(index=0, id=self.call_id, type="function",
                                 function=DeltaFunctionCall(name=self.req.tool_choice.function.name,
                                                            arguments=text))
        elif text:
            call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))
        else:
            return DeltaMessage(), finish
        return DeltaMessage(tool_calls=[call]), finish

    def _required(self, text: str, finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
        self.text += text
        calls = [DeltaToolCall(index=e.index, function=DeltaFunctionCall(arguments=e.arguments))
                 if e.name is None else
                 DeltaToolCall(index=e.index, id=new_call_id(), type="function",
                               function=DeltaFunctionCall(name=e.name, arguments=e.arguments))
                 for e in self.calls.feed(text)]
        if finish_reason is None:
            return DeltaMessage(tool_calls=calls or None), None
        if not self.calls.names:  # nothing became a call: the text is the answer
            return DeltaMessage(content=self.text or None), finish_reason
        finish = finish_reason if finish_reason == "length" or not self.calls.complete else "tool_calls"
        return DeltaMessage(tool_calls=calls or None), finish

    def _finish(self, finish_reason: str) -> tuple[DeltaMessage, str | None]:
        held, self.held = self.held, ""
        if self.mode == "auto" and not self.in_calls:
            return DeltaMessage(content=held or None), finish_reason
        message, finish = final_message(self.req, held, finish_reason)
        if not message.tool_calls:
            return DeltaMessage(content=held or None), finish
        calls = [DeltaToolCall(index=i, id=c.id, type="function",
                               function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                 for i, c in enumerate(message.tool_calls)]
        return DeltaMessage(content=message.content, tool_calls=calls), finish
