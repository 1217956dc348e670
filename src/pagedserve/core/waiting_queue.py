"""The waiting queue: the sequence with the smallest key is admitted next (ties: the earlier arrival).

Fairness between client requests (start-time fair queuing, one sequence = one unit): the sequences of one
client request (an HTTP request's prompts, an LLM.generate call) get tags now, now + 1, now + 2, ... where
`now` counts scheduler steps; a later request's first sequence is tagged with its own arrival step. So one
request with 1,000 prompts interleaves with those that come after it: a request arriving k steps later waits
behind about k of the big one's sequences, not all 1,000. A request of one sequence is tagged with its
arrival step, so single requests are served first come, first served.

The policy (core/scheduling_policy.py) turns the tag into the key. A preempted sequence keeps its key, so it
comes back ahead of what arrived after it. Forks released by their source's prefill go to the very front:
they share the source's prompt blocks only while the source holds them.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterator

from pagedserve.core.request import Request


class WaitingQueue:
    def __init__(self, policy) -> None:
        self.policy = policy
        self.now = 0                                     # scheduler steps so far (the fairness clock)
        # (queue key, push id, request); an entry is live while _live[req_id] is its push id (lazy removal).
        self._heap: list[tuple[tuple[int, int], int, Request]] = []
        self._live: dict[str, int] = {}
        self._front: deque[Request] = deque()
        self._push_ids = itertools.count()
        self._arrivals = itertools.count()
        self._last_tag: dict[str, int] = {}              # client request -> tag of its last sequence

    def add(self, req: Request) -> None:
        # A new arrival gets its key; a preempted sequence comes back with the key it had.
        self._assign_key(req)
        push_id = next(self._push_ids)
        self._live[req.req_id] = push_id
        heapq.heappush(self._heap, (req.queue_key, push_id, req))

    def add_front(self, req: Request) -> None:
        self._assign_key(req)  # it ranks by its key once running
        self._front.append(req)

    def _assign_key(self, req: Request) -> None:
        if req.queue_key is not None:
            return
        group = req.client_request_id or req.req_id
        last = self._last_tag.get(group)
        tag = self.now if last is None else max(self.now, last + 1)
        self._last_tag[group] = tag
        req.queue_key = (self.policy.queue_key(req, tag), next(self._arrivals))
        if len(self._last_tag) > 2 * len(self) + 64:
            # A group whose last tag is behind the clock gets `now` anyway: forget it.
            self._last_tag = {g: t for g, t in self._last_tag.items() if t >= self.now}

    def peek(self) -> Request | None:
        if self._front:
            return self._front[0]
        heap = self._heap
        while heap and self._live.get(heap[0][2].req_id) != heap[0][1]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def pop(self) -> Request:
        req = self.peek()
        if self._front:
            self._front.popleft()
        else:
            heapq.heappop(self._heap)
            del self._live[req.req_id]
        return req

    def remove(self, req: Request) -> None:
        if self._live.pop(req.req_id, None) is None:
            self._front.remove(req)

    def __contains__(self, req: Request) -> bool:
        return req.req_id in self._live or req in self._front

    def __len__(self) -> int:
        return len(self._live) + len(self._front)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Request]:
        # In admission order (for tests and debugging; O(n log n)).
        live = sorted(e for e in self._heap if self._live.get(e[2].req_id) == e[1])
        return iter([*self._front, *(e[2] for e in live)])
