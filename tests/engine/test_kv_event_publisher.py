"""The ZMQ publisher on real sockets: a block pool's events, read back as llm-d's vLLM adapter reads them and
with vLLM's own msgspec structs, the sequence numbers, the replay socket, both socket modes, and the config."""
from __future__ import annotations

import time

import msgpack
import msgspec
import pytest
import zmq

from pagedserve.config import KVEventsConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_events import AllBlocksCleared, KVEventCollector
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.kv_event_publisher import (ZmqEventPublisher, default_topic, encode_batch,
                                                  with_served_model_topic)
from tests.core.helpers import make_request
from tests.core.test_cache_salt import prefill, salted
from tests.core.test_kv_events import chain
from tests.engine.kv_event_reader import Cleared, Removed, Stored, decode_message, receive, replay

TOPIC = "kv@10.1.2.3@smol"


# vLLM's event structs (vllm/distributed/kv_events.py) in the array_like layout its publishers and llm-d's
# adapter use, strictly typed: a field out of place fails the decode.
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


@pytest.fixture
def ctx():
    return zmq.Context.instance()


def subscribe(ctx, endpoint: str, bind: bool = False) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.bind(endpoint) if bind else sub.connect(endpoint)
    return sub


def wait_subscribed(pub: ZmqEventPublisher, sub: zmq.Socket) -> int:
    # A PUB drops what it sends before the subscription reaches it; probe until one arrives. Returns the next
    # sequence number the publisher will use.
    for _ in range(100):
        pub.publish([AllBlocksCleared()])
        batch = receive(sub, 0.1)
        if batch is not None:
            while (more := receive(sub, 0.2)) is not None:
                batch = more
            return batch.seq + 1
    raise AssertionError("the subscription never reached the publisher")


def steps_of_a_pool(events: KVEventCollector) -> list[list]:
    # Three engine steps' worth of events: a salted prefill, a plain one, then one that evicts.
    kv = KVCacheManager(6, 4, hash_root=b"root", kv_events=events)
    steps = []
    a = salted("a", "tenant-9", prompt_len=9)
    prefill(kv, a)
    steps.append(events.take())
    b = make_request("b", prompt_len=8, first_token=100)
    prefill(kv, b)
    steps.append(events.take())
    kv.free(a)
    kv.free(b)
    prefill(kv, make_request("c", prompt_len=24, first_token=300))
    steps.append(events.take())
    return steps, a, b


def test_pool_events_read_back_as_llm_d_reads_them(ctx):
    config = KVEventsConfig(True, endpoint="tcp://127.0.0.1:*")
    pub = ZmqEventPublisher(config, TOPIC)
    sub = subscribe(ctx, pub.endpoint)
    try:
        seq = wait_subscribed(pub, sub)
        steps, a, b = steps_of_a_pool(KVEventCollector(4))
        t0 = time.time()
        for events in steps:
            pub.publish(events)
        pub.publish([])  # an empty step sends nothing and takes no sequence number
        batches = [receive(sub) for _ in steps]
        assert receive(sub, 0.3) is None
    finally:
        sub.close()
        pub.shutdown()
    assert [bt.seq for bt in batches] == [seq, seq + 1, seq + 2]
    assert all((bt.pod, bt.model, bt.data_parallel_rank) == ("10.1.2.3", "smol", 0) for bt in batches)
    assert all(t0 - 1 < bt.ts < time.time() + 1 for bt in batches)
    ha, hb = chain(a.all_token_ids, salt="tenant-9"), chain(b.all_token_ids)
    assert batches[0].events == [Stored(ha, None, a.all_token_ids[:8], 4, "GPU", [["tenant-9"], None])]
    assert batches[1].events == [Stored(hb, None, b.all_token_ids, 4, "GPU", [None, None])]
    # c needs all 6 blocks: the free queue holds the never-used block 5, then a's blocks tail first (2 has no
    # hash, then 1 and 0), then b's 4 and 3 (b was freed after a).
    removed = [e for e in batches[2].events if isinstance(e, Removed)]
    assert removed == [Removed([ha[1]], "GPU"), Removed([ha[0]], "GPU"), Removed([hb[1]], "GPU"),
                       Removed([hb[0]], "GPU")]
    [stored] = [e for e in batches[2].events if isinstance(e, Stored)]
    assert stored.token_ids == list(range(303, 327)) and stored.parent is None and len(stored.hashes) == 6


def test_layout_is_vllms_array_like_structs(ctx):
    steps, a, _ = steps_of_a_pool(KVEventCollector(4))
    payload = encode_batch(12.5, steps[0] + steps[2] + [AllBlocksCleared()])
    batch = msgspec.msgpack.decode(payload, type=VKVEventBatch)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    first = batch.events[0]
    assert (first.block_hashes, first.parent_block_hash, first.token_ids, first.block_size, first.medium,
            first.extra_keys, first.group_idx) == (chain(a.all_token_ids, salt="tenant-9"), None,
                                                   a.all_token_ids[:8], 4, "GPU", [("tenant-9",), None], 0)
    assert [type(e).__name__[1:] for e in batch.events] == ["BlockStored"] + ["BlockRemoved"] * 4 + \
        ["BlockStored", "AllBlocksCleared"]
    # Every field present, as msgspec writes an array_like struct: 12 items with the tag.
    raw = msgpack.unpackb(payload)[1]
    assert [len(e) for e in raw] == [12, 4, 4, 4, 4, 12, 1]
    # vLLM's own encoder writes these events to the same bytes.
    assert msgspec.msgpack.encode(VEventBatch(12.5, batch.events, 0)) == payload


def test_replay_resends_buffered_batches_then_the_end_marker(ctx):
    config = KVEventsConfig(True, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                            buffer_steps=3)
    pub = ZmqEventPublisher(config, TOPIC)
    sub = subscribe(ctx, pub.endpoint)
    try:
        seq = wait_subscribed(pub, sub)
        steps, _, _ = steps_of_a_pool(KVEventCollector(4))
        for events in steps:
            pub.publish(events)
        live = [sub.recv_multipart() for _ in steps]
        again = replay(ctx, pub.replay_endpoint, seq + 1)
        assert [(s, p) for s, p in again] == [(seq + 1, live[1][2]), (seq + 2, live[2][2])]
        # Only buffer_steps batches are kept: a replay from 0 starts at the oldest one left.
        assert [s for s, _ in replay(ctx, pub.replay_endpoint, 0)] == [seq, seq + 1, seq + 2]
        assert replay(ctx, pub.replay_endpoint, seq + 3) == []
        assert decode_message([TOPIC.encode(), again[0][0].to_bytes(8, "big"), again[0][1]]).seq == seq + 1
    finally:
        sub.close()
        pub.shutdown()


def test_a_publisher_without_wildcard_connects_to_a_central_subscriber(ctx):
    port_probe = ctx.socket(zmq.SUB)
    port = port_probe.bind_to_random_port("tcp://127.0.0.1")
    port_probe.setsockopt(zmq.LINGER, 0)
    port_probe.setsockopt(zmq.SUBSCRIBE, b"")
    pub = ZmqEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{port}"), TOPIC)
    try:
        wait_subscribed(pub, port_probe)
        pub.publish([AllBlocksCleared()])
        assert receive(port_probe).events == [Cleared()]
    finally:
        port_probe.close()
        pub.shutdown()


def test_config_parsing_and_errors():
    config = EngineArgs(kv_events_config='{"enable_kv_cache_events": true, "publisher": "zmq", '
                                         '"endpoint": "tcp://*:5557", "topic": "t"}').create_engine_config()
    assert config.kv_events == KVEventsConfig(True, "zmq", "tcp://*:5557", topic="t") and config.kv_events.active
    assert EngineArgs().create_engine_config().kv_events is None
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).active
    assert not KVEventsConfig.parse({}).active
    for bad, match in [('{"enable_kv_cache_events": true, "bogus": 1}', "unknown kv_events_config keys"),
                       ('{"publisher": "kafka"}', "publisher"), ('{"endpoint": "5557"}', "ZMQ address"),
                       ('{"buffer_steps": 0}', "buffer_steps"), ("[1]", "JSON object"), ("{", "valid JSON"),
                       ('{"enable_kv_cache_events": "yes"}', "true or false"), ('{"topic": 5}', "topic")]:
        with pytest.raises(ValueError, match=match):
            KVEventsConfig.parse(bad)
    with pytest.raises(ValueError, match="cannot open"):
        ZmqEventPublisher(KVEventsConfig(True, endpoint="tcp://256.0.0.1:*"), TOPIC)


def test_default_topic_names_the_pod_ip(monkeypatch):
    monkeypatch.setenv("POD_IP", "10.0.0.7")
    assert default_topic("smol") == "kv@10.0.0.7@smol"
    monkeypatch.delenv("POD_IP")
    assert default_topic("m").startswith("kv@") and default_topic("m").endswith("@m")


def test_the_server_names_the_served_model_in_the_topic(monkeypatch):
    monkeypatch.setenv("POD_IP", "10.0.0.8")
    config = EngineArgs(kv_events_config={"enable_kv_cache_events": True}).create_engine_config()
    assert with_served_model_topic(config, "smol").kv_events.topic == "kv@10.0.0.8@smol"
    pinned = EngineArgs(kv_events_config={"enable_kv_cache_events": True, "topic": "kv@x@y"}).create_engine_config()
    assert with_served_model_topic(pinned, "smol").kv_events.topic == "kv@x@y"
    assert with_served_model_topic(EngineArgs().create_engine_config(), "smol").kv_events is None
