"""Per-request output collectors (vLLM's RequestOutputCollector), read by one consumer on the event loop.

A consumer that falls behind never makes the server hold more than one pending output per request: DELTA
outputs are merged into one (text and tokens appended), CUMULATIVE and FINAL_ONLY ones replace the older one.
So a stalled client costs O(its output), never a queue of cumulative copies.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pagedserve.outputs import RequestOutput


@dataclass(slots=True, eq=False)
class OutputStream:
    """Outputs of one or more requests added together (a completion with several prompts).

    Leaving the iteration early (break, cancellation, client disconnect) or close() aborts what is unfinished.
    """
    owner: Any  # the AsyncLLMEngine
    request_ids: list[str]
    delta_ids: set[str] = field(default_factory=set)  # requests whose outputs are RequestOutputKind.DELTA
    priority: int = 0  # the requests' scheduling priority (lower first under the priority policy)
    unfinished: set[str] = field(default_factory=set)
    pending: dict[str, RequestOutput] = field(default_factory=dict)
    error: BaseException | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.unfinished = set(self.request_ids)

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def put(self, out: RequestOutput) -> None:
        prev = self.pending.get(out.request_id)
        if prev is not None and out.request_id in self.delta_ids:
            out = merge_deltas(prev, out)
        self.pending[out.request_id] = out
        self.ready.set()

    def fail(self, request_id: str, error: BaseException) -> None:
        self.unfinished.discard(request_id)
        if self.error is None:
            self.error = error
        self.ready.set()

    def close(self) -> None:
        if self.unfinished:
            self.owner.abort(sorted(self.unfinished))
            self.unfinished.clear()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while self.unfinished or self.pending:
                if not self.pending and self.error is None:
                    self.ready.clear()
                    await self.ready.wait()
                if self.error is not None:
                    raise self.error
                outs, self.pending = list(self.pending.values()), {}
                for out in outs:
                    if out.finished:
                        self.unfinished.discard(out.request_id)
                    yield out
        finally:
            self.close()


def merge_deltas(prev: RequestOutput, new: RequestOutput) -> RequestOutput:
    # Two DELTA outputs of one request as one: per sample, text, tokens and logprobs appended.
    by_index = {c.index: c for c in prev.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            by_index[c.index] = c
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if old.logprobs is not None and c.logprobs is not None:
            old.logprobs = old.logprobs + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    new.outputs = sorted(by_index.values(), key=lambda c: c.index)
    if prev.prompt_logprobs is not None:
        new.prompt_logprobs = prev.prompt_logprobs
    return new
