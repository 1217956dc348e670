"""A choice's text as a chat message: reasoning, content and tool calls, whole or as OpenAI stream deltas.

    text --reasoning parser (if any)--> reasoning_content
                                    \\-> content --tool parser--> content, tool_calls

Per tool_choice:
    none      the content is the answer
    auto      the --tool-call-parser reads calls out of the content (server/tool_parsers.py); streamed, content
              flows until a call may be starting, then each call opens with a delta carrying its id, type and
              name, followed by its arguments as they come
    required  the grammar makes the text a JSON array of calls, read (and streamed) as auto reads its formats
    named     the text is the call's arguments: a first delta with id, type and name, then arguments as they come
Named and required calls are decoded under a grammar from the first token, so they have no reasoning part. A
finish that cut the calls short (finish_reason "length") leaves their text as content.
"""
from __future__ import annotations

from pagedserve.server.protocol import (ChatCompletionRequest, ChatResponseMessage, DeltaFunctionCall,
                                        DeltaMessage, DeltaToolCall, FunctionCall, ToolCall)
from pagedserve.server.reasoning import REASONING_PARSERS, ReasoningParser
from pagedserve.server.tool_parsers import RequiredToolParser, ToolParser, make_tool_parser, new_call_id
from pagedserve.server.tool_scanner import CallEvent


def _tool_parser(req: ChatCompletionRequest, tool_call_parser: str | None) -> ToolParser | None:
    names = {t.function.name for t in req.tools or ()}
    if req.tool_mode == "auto":
        return make_tool_parser(tool_call_parser, names)
    return RequiredToolParser(names) if req.tool_mode == "required" else None


def _reasoning_parser(req: ChatCompletionRequest, reasoning_parser: str | None) -> ReasoningParser | None:
    if reasoning_parser is None or req.tool_mode in ("named", "required"):
        return None
    thinking = (req.chat_template_kwargs or {}).get("enable_thinking", True) is not False
    free = req.structured_outputs is None and (req.response_format is None or req.response_format.type == "text")
    return REASONING_PARSERS[reasoning_parser](thinking, free)


def final_message(req: ChatCompletionRequest, text: str, finish_reason: str | None,
                  tool_call_parser: str | None = None, reasoning_parser: str | None = None
                  ) -> tuple[ChatResponseMessage, str | None]:
    if req.tool_mode == "named" and finish_reason != "length":
        call = ToolCall(id=new_call_id(), function=FunctionCall(name=req.tool_choice.function.name, arguments=text))
        return ChatResponseMessage(content=None, tool_calls=[call]), "tool_calls"
    reasoning, content = None, text
    thinker = _reasoning_parser(req, reasoning_parser)
    if thinker is not None:
        reasoning, content = thinker.extract(text)
        content = content or None
    tools = _tool_parser(req, tool_call_parser)
    if tools is None or finish_reason == "length" or content is None:
        return ChatResponseMessage(content=content, reasoning_content=reasoning), finish_reason
    extracted = tools.extract(content)
    if not extracted.calls:
        return ChatResponseMessage(content=content, reasoning_content=reasoning), finish_reason
    calls = [ToolCall(id=i, function=FunctionCall(name=n, arguments=a)) for i, n, a in extracted.calls]
    return ChatResponseMessage(content=extracted.content, reasoning_content=reasoning, tool_calls=calls), \
        "tool_calls"


class ChoiceStreamer:
    """Turns one choice's text deltas into DeltaMessages."""

    def __init__(self, req: ChatCompletionRequest, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.req = req
        self.thinker = _reasoning_parser(req, reasoning_parser)
        self.tools = _tool_parser(req, tool_call_parser)
        self.call_id: str | None = None  # named: the call's id once its first delta went out

    def delta(self, text: str, finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
        if self.req.tool_mode == "named":
            return self._named(text, finish_reason)
        reasoning, content = "", text
        if self.thinker is not None:
            reasoning, content = self.thinker.feed(text)
            if finish_reason is not None:
                more_reasoning, more_content = self.thinker.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self.tools is None:
            return DeltaMessage(reasoning_content=reasoning or None, content=content or None), finish_reason
        piece = self.tools.feed(content)
        events = piece.events
        if finish_reason is not None:
            rest, complete = self.tools.finish()
            piece.content += rest.content
            if complete and finish_reason != "length":
                finish_reason = "tool_calls"
        calls = [self._call_delta(e) for e in events]
        return DeltaMessage(reasoning_content=reasoning or None, content=piece.content or None,
                            tool_calls=calls or None), finish_reason

    def _call_delta(self, event: CallEvent) -> DeltaToolCall:
        if event.name is None:
            return DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.arguments))
        return DeltaToolCall(index=event.index, id=self.tools.call_ids[event.index], type="function",
                             function=DeltaFunctionCall(name=event.name, arguments=event.arguments))

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
