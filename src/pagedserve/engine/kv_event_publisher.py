"""Publishes the prefix cache's KV events over ZMQ, byte for byte in vLLM's format, for cache-aware routers.

Each engine step with events becomes one batch on a PUB socket, as a three-frame message:

    [topic, sequence (8 bytes, big-endian, from 0, no gaps), msgpack EventBatch]
    EventBatch  = [ts, [event, ...], data_parallel_rank]
    BlockStored = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                   lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]
    BlockRemoved = ["BlockRemoved", block_hashes, medium, group_idx]
    AllBlocksCleared = ["AllBlocksCleared"]

That is vLLM's msgspec structs (vllm/distributed/kv_events.py) with array_like=True: positional, the tag first,
every field present (None when unset). Consumers that know fewer fields (llm-d-kv-cache's vLLM adapter reads the
first eight of BlockStored) skip the rest. A ROUTER socket (replay_endpoint) answers a request [b"", start
sequence as 8 bytes] with every buffered batch from that sequence on, each as [b"", sequence, payload], then
[b"", -1 as 8 signed bytes, b""].

A thread owns both sockets (ZMQ sockets are not thread-safe); the engine thread only queues its events.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import threading
import time
from collections import deque

import msgpack
import zmq

from pagedserve.config import EngineConfig, KVEventsConfig
from pagedserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = object()


def default_topic(model: str) -> str:
    # llm-d's subscriber reads the pod and the model from kv@<pod>@<model>. POD_IP comes from the pod spec
    # (the Helm chart sets it from status.podIP).
    pod_ip = os.environ.get("POD_IP")
    if not pod_ip:
        try:
            pod_ip = socket.gethostbyname(socket.gethostname())
        except OSError:
            pod_ip = "127.0.0.1"
    return f"kv@{pod_ip}@{model}"


def with_served_model_topic(config: EngineConfig, served_name: str) -> EngineConfig:
    # Routers match the topic's model against the "model" requests carry: the served name, which only the
    # server knows (the engine's default is the model's own name).
    if config.kv_events is None or config.kv_events.topic:
        return config
    return dataclasses.replace(config, kv_events=dataclasses.replace(config.kv_events,
                                                                     topic=default_topic(served_name)))


def wire(event: KVEvent) -> list:
    if isinstance(event, BlockStored):
        return ["BlockStored", list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                event.block_size, None, event.medium, None, [None if k is None else list(k) for k in event.extra_keys],
                0, None, None]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium, 0]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(ts: float, events: list[KVEvent], data_parallel_rank: int = 0) -> bytes:
    return msgpack.packb([ts, [wire(e) for e in events], data_parallel_rank], use_bin_type=True)


def should_bind(endpoint: str) -> bool:
    # vLLM's rule: a wildcard or a local transport is ours to bind; anything else is a peer to connect to.
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    SHUTDOWN_TIMEOUT_S = 2.0

    def __init__(self, config: KVEventsConfig, topic: str, data_parallel_rank: int = 0) -> None:
        self.topic = topic
        self._topic = topic.encode("utf-8")
        self._dp_rank = data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if should_bind(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {config.endpoint!r} / {config.replay_endpoint!r}: "
                             f"{exc}") from None
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode() if should_bind(config.endpoint) \
            else config.endpoint
        self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode() if self._replay else None
        self.num_published = 0
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (topic %r)%s", self.endpoint, topic,
                    f", replay on {self.replay_endpoint}" if self._replay else "")

    def publish(self, events: list[KVEvent]) -> None:
        # Called by the engine thread once per step; blocks only when max_queue_size batches are waiting.
        if events:
            self._queue.put((time.time(), events))

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("KV event publisher did not stop within %.1f s", self.SHUTDOWN_TIMEOUT_S)
        else:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            ts, events = item
            try:
                payload = encode_batch(ts, events, self._dp_rank)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # noqa: BLE001 (a bad batch must not stop the thread; the gap shows in seq)
                logger.exception("KV event batch %d not published", seq)
            else:
                self._buffer.append((seq, payload))
                self.num_published += 1
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignored a replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def make_publisher(config: KVEventsConfig | None, model: str) -> ZmqEventPublisher | None:
    if config is None or not config.active:
        return None
    return ZmqEventPublisher(config, config.topic or default_topic(model))
