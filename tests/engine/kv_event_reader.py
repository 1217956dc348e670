"""A KV-event subscriber that reads messages the way llm-d-kv-cache's vLLM adapter does (vllm_adapter.go).

The adapter takes exactly three frames, an 8-byte big-endian sequence and a kv@<pod>@<model> topic; it
decodes the payload as the array [ts, events, data_parallel_rank] and each event as an array whose first item
is the tag, reading BlockStored's fields by position: block hashes, parent hash, token ids, block size, lora id,
medium, lora name (extra_keys is the ninth item, which vLLM exposes for consumers that rebuild hashes). A hash
may be an integer or bytes, whose last eight bytes are read big-endian.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import zmq


def hash_as_uint64(raw) -> int:
    if isinstance(raw, int):
        return raw & (2 ** 64 - 1)
    assert isinstance(raw, bytes) and raw, f"unsupported hash {raw!r}"
    return int.from_bytes(raw[-8:].rjust(8, b"\0"), "big")


@dataclass
class Stored:
    hashes: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None
    extra_keys: list | None


@dataclass
class Removed:
    hashes: list[int]
    medium: str | None


@dataclass
class Cleared:
    pass


@dataclass
class Batch:
    seq: int
    pod: str
    model: str
    ts: float
    events: list = field(default_factory=list)
    data_parallel_rank: int | None = None


def decode_event(raw: list):
    tag = raw[0]
    if tag == "BlockStored":
        assert len(raw) >= 8, raw
        parent = None if raw[2] is None else hash_as_uint64(raw[2])
        return Stored([hash_as_uint64(h) for h in raw[1]], parent, list(raw[3]), raw[4], raw[6],
                      raw[8] if len(raw) > 8 else None)
    if tag == "BlockRemoved":
        return Removed([hash_as_uint64(h) for h in raw[1]], raw[2] if len(raw) > 2 else None)
    if tag == "AllBlocksCleared":
        return Cleared()
    raise AssertionError(f"unknown vLLM event tag {tag!r}")


def decode_message(parts: list[bytes]) -> Batch:
    assert len(parts) == 3, f"expected 3 message parts, got {len(parts)}"
    topic, seq_bytes, payload = parts
    assert len(seq_bytes) == 8
    pieces = topic.decode().split("@")
    assert len(pieces) == 3 and pieces[0] == "kv", topic
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
    return Batch(int.from_bytes(seq_bytes, "big"), pieces[1], pieces[2], ts, [decode_event(e) for e in events],
                 dp_rank)


def receive(sub: zmq.Socket, timeout_s: float = 10.0) -> Batch | None:
    if not sub.poll(int(timeout_s * 1000)):
        return None
    return decode_message(sub.recv_multipart())


def replay(ctx: zmq.Context, endpoint: str, start_seq: int, timeout_s: float = 10.0) -> list[tuple[int, bytes]]:
    # vLLM's replay protocol, as its subscribers speak it: a DEALER sends [b"", start]; the answers are
    # [b"", seq, payload] until seq -1.
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(int(timeout_s * 1000)), "no replay answer"
            _, seq_bytes, payload = sock.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return out
            out.append((seq, payload))
    finally:
        sock.close()
