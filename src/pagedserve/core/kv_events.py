"""KV cache events: every block a prefix-cache tier stores or drops, in the order it happened.

A router that knows which replica holds which prefix can send a request where its prompt is already cached
(llm-d's precise prefix scorer, Dynamo, ...). The tiers report here; the engine hands each step's events to the
publisher (engine/kv_event_publisher.py), which puts them on the wire in vLLM's format.

    block pool (medium "GPU")  ---+
    disk tier  (medium "DISK") ---+--> KVEventCollector --take()--> publisher (one batch per engine step)

The medium of the block pool is "GPU" although it lives in host memory: vLLM names its primary tier so, and
consumers (llm-d's indexer) treat that name as "the engine's own KV pool". Pure Python, no torch.

Hashes: a tier reports its 32-byte block digests; events carry vLLM's default external form, the digest's last
8 bytes read big-endian as an unsigned integer (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1). The token ids of each
stored block travel with it, so a consumer can key blocks by its own hash of the tokens.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

MEDIUM_GPU = "GPU"
MEDIUM_DISK = "DISK"


def external_hash(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class BlockStored:
    # Consecutive blocks of one sequence: block_hashes[i] holds token_ids[i*block_size:(i+1)*block_size], and
    # parent_block_hash is the block before the first (None when the first block starts the sequence).
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    # One entry per block: the keys besides the tokens that went into its hash, None for none. The cache
    # salt is the first block's only extra key, as in vLLM.
    extra_keys: tuple[tuple[str, ...] | None, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class TierEvents:
    """The recorder one tier holds: it stamps its medium and the block size on every event."""

    __slots__ = ("medium", "block_size", "_collector")

    def __init__(self, collector: KVEventCollector, medium: str) -> None:
        self.medium = medium
        self.block_size = collector.block_size
        self._collector = collector

    def stored(self, block_hashes: Sequence[bytes], parent_hash: bytes | None, token_ids: Sequence[int],
               extra_keys: Sequence[tuple[str, ...] | None] | None = None) -> None:
        if not block_hashes:
            return
        if len(token_ids) != len(block_hashes) * self.block_size:
            raise ValueError(f"{len(block_hashes)} blocks of {self.block_size} tokens need "
                             f"{len(block_hashes) * self.block_size} token ids, got {len(token_ids)}")
        keys = tuple(extra_keys) if extra_keys is not None else (None,) * len(block_hashes)
        if len(keys) != len(block_hashes):
            raise ValueError(f"extra_keys has {len(keys)} entries for {len(block_hashes)} blocks")
        self._collector.add(BlockStored(
            tuple(external_hash(h) for h in block_hashes),
            None if parent_hash is None else external_hash(parent_hash),
            tuple(token_ids), self.block_size, self.medium, keys))

    def removed(self, block_hashes: Sequence[bytes]) -> None:
        if block_hashes:
            self._collector.add(BlockRemoved(tuple(external_hash(h) for h in block_hashes), self.medium))

    def cleared(self) -> None:
        self._collector.add(AllBlocksCleared())


class KVEventCollector:
    """Events of all tiers in one order. Tiers may record from other threads (a disk writer); take() hands the
    events over once, oldest first."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()

    def tier(self, medium: str) -> TierEvents:
        return TierEvents(self, medium)

    def add(self, event: KVEvent) -> None:
        with self._lock:
            self._events.append(event)

    def take(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events
