"""Sampled block residency, for vLLM's histograms kv_block_lifetime_seconds, kv_block_idle_before_evict_seconds
and kv_block_reuse_gap_seconds.

One allocation in `sample_every` is followed through its life. An access is a reference taken on the block
after its allocation (a prefix-cache hit or a fork). The life ends when the pool hands the block out again.
If the block still held cached contents then (it had a hash), that hand-out is its eviction and one event is
recorded; a block that never became cacheable (a partly filled tail block) just stops being followed:

    allocated ---- access ------- access ---- freed (cached, evictable) ........ evicted
    |<-------------------------------- lifetime --------------------------------------->|
                                  |<--------------- idle before evict ------------------->|
    |<-- gap -->|<--- gap --->|  (reuse gaps: between consecutive accesses, the allocation counting as one)

Only sampled blocks read the clock: the pool pays a counter increment per allocation otherwise. Events wait in
a bounded deque that the exporter drains from another thread (deque append and popleft are atomic).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

RESIDENCY_SAMPLE_EVERY = 8
MAX_REUSE_GAPS = 4          # per block: the most recent ones, like vLLM's ring of accesses
MAX_PENDING_EVENTS = 4096   # nobody scraping must not grow memory


@dataclass(frozen=True, slots=True)
class ResidencyEvent:
    lifetime_s: float
    idle_s: float
    reuse_gaps_s: tuple[float, ...]


@dataclass(slots=True)
class BlockTrack:
    # Kept on a sampled KVBlock (KVBlock.residency) from its allocation until it is handed out again.
    allocated_at: float
    last_access: float
    reuse_gaps: list[float] = field(default_factory=list)


class ResidencySampler:
    def __init__(self, sample_every: int = RESIDENCY_SAMPLE_EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if sample_every < 0:
            raise ValueError(f"sample_every must be >= 0 (0 turns sampling off), got {sample_every}")
        self.sample_every = sample_every
        self.clock = clock
        self.events: deque[ResidencyEvent] = deque(maxlen=MAX_PENDING_EVENTS)
        self._num_allocations = 0

    def on_allocate(self, block, evicted: bool) -> None:
        # Called as the pool hands `block` out; `evicted`: it still held cached contents, now overwritten.
        now = None
        track = block.residency
        if track is not None:  # its previous life ends here
            if evicted:
                now = self.clock()
                self.events.append(ResidencyEvent(now - track.allocated_at, now - track.last_access,
                                                  tuple(track.reuse_gaps)))
            block.residency = None
        if self.sample_every:
            self._num_allocations += 1
            if self._num_allocations % self.sample_every == 0:
                now = self.clock() if now is None else now
                block.residency = BlockTrack(now, now)

    def on_access(self, block) -> None:
        track = block.residency
        if track is None:
            return
        now = self.clock()
        track.reuse_gaps.append(now - track.last_access)
        if len(track.reuse_gaps) > MAX_REUSE_GAPS:
            del track.reuse_gaps[0]
        track.last_access = now

    def drain(self) -> list[ResidencyEvent]:
        # Any thread: takes what is there now; events appended meanwhile wait for the next drain.
        out = []
        for _ in range(len(self.events)):
            out.append(self.events.popleft())
        return out
