"""StreamChunks writes the same SSE bytes as the pydantic models it stands in for (server/streaming.py)."""
from __future__ import annotations

import pytest

from pagedserve.server.protocol import (ChatCompletionStreamResponse, ChatStreamChoice, CompletionChoice,
                                        CompletionStreamResponse, DeltaMessage, UsageInfo)
from pagedserve.server.streaming import StreamChunks, sse

# Quotes, backslashes, every control character, DEL, non-ASCII (2-, 3- and 4-byte UTF-8), the line separators
# JSON leaves raw but JavaScript does not, the replacement character.
TEXTS = ["", " hello", 'say "hi"\\n', "".join(map(chr, range(0x20))), "\x7f", "caf\u00e9 \u4e2d\u6587 \U0001f600",
         "\u2028\u2029", "\ufffd", "</script>"]
ENDS = [(None, None), ("stop", None), ("stop", 2), ("stop", "\n\nQ:"), ("length", None)]
FRAME = dict(id="cmpl-abc123", created=1_796_000_000, model='smol "model"/Q4_1')


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish_reason,stop_reason", ENDS)
def test_completion_chunk_equals_the_model(text, finish_reason, stop_reason):
    chunks = StreamChunks(CompletionStreamResponse(**FRAME, choices=[]))
    choice = CompletionChoice(index=3, text=text, finish_reason=finish_reason, stop_reason=stop_reason)
    expected = sse(CompletionStreamResponse(**FRAME, choices=[choice]))
    assert chunks.text(3, text, finish_reason, stop_reason) == expected
    assert chunks.event(choice) == expected


@pytest.mark.parametrize("content", TEXTS + [None])
@pytest.mark.parametrize("finish_reason,stop_reason", ENDS)
def test_chat_chunk_equals_the_model(content, finish_reason, stop_reason):
    frame = dict(FRAME, id="chatcmpl-abc123")
    chunks = StreamChunks(ChatCompletionStreamResponse(**frame, choices=[]))
    choice = ChatStreamChoice(index=1, delta=DeltaMessage(content=content), finish_reason=finish_reason,
                              stop_reason=stop_reason)
    expected = sse(ChatCompletionStreamResponse(**frame, choices=[choice]))
    assert chunks.content(1, content, finish_reason, stop_reason) == expected
    assert chunks.event(choice) == expected


def test_a_frame_without_empty_choices_is_refused():
    usage = UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    with pytest.raises(ValueError, match="no empty choices"):
        StreamChunks(CompletionStreamResponse(**FRAME, choices=[CompletionChoice(index=0, text="x")], usage=usage))
