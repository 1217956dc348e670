"""Reasoning parsers, by vLLM's --reasoning-parser names: the <think>...</think> part of a message goes to
reasoning_content, the rest to content (where tool calls are then looked for).

    deepseek_r1  DeepSeek-R1 (and its distills): the chat template ends the prompt with "<think>\\n", so all text
                 before </think> is reasoning, with or without a <think> of its own
    qwen3        Qwen3: reasoning only when the message opens with <think>

With chat_template_kwargs {"enable_thinking": false} there is no reasoning: all text is content.
"""
from __future__ import annotations

from typing import ClassVar

from pagedserve.server.markers import marker_prefix_len

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    name: ClassVar[str]
    thinking_in_prompt: ClassVar[bool]  # text before </think> is reasoning even without <think>

    def __init__(self, enable_thinking: bool = True, free_decoding: bool = True) -> None:
        # Under a grammar (response_format, structured outputs) the text cannot have started inside a thought.
        self.implicit = self.thinking_in_prompt and free_decoding
        self.state = "start" if enable_thinking else "content"  # start -> reasoning -> after -> content
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that may be sent now."""
        self.held += text
        reasoning = ""
        if self.state == "start":
            stripped = self.held.lstrip()
            if len(stripped) < len(THINK_START) and THINK_START.startswith(stripped):
                return "", ""  # may still open with <think>
            if stripped.startswith(THINK_START):
                self.held, self.state = stripped[len(THINK_START):], "reasoning"
            else:
                self.state = "reasoning" if self.implicit else "content"
        if self.state == "reasoning":
            end = self.held.find(THINK_END)
            if end < 0:
                keep = marker_prefix_len(self.held, THINK_END)
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return reasoning, ""
            reasoning, self.held, self.state = self.held[:end], self.held[end + len(THINK_END):], "after"
        if self.state == "after":  # the whitespace between </think> and the answer is neither
            self.held = self.held.lstrip()
            if not self.held:
                return reasoning, ""
            self.state = "content"
        content, self.held = self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "reasoning" or self.state == "start" and self.implicit:
            return held, ""
        return "", held

    def extract(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None when there was none, content) of a whole message."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        reasoning += more_reasoning
        return reasoning or None, content + more_content


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    thinking_in_prompt = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    thinking_in_prompt = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}
