"""KV events from a running engine (the embedded model), received over ZMQ as a central endpoint picker receives
them: the stored blocks' token ids rebuild prompt and output, salts ride in extra_keys, prefix hits add
nothing, evictions arrive as BlockRemoved, and the stream replayed equals the pool's cache."""
from __future__ import annotations

import random

import pytest
import zmq

from pagedserve import SamplingParams
from pagedserve.core.kv_events import external_hash
from tests.engine.kv_event_reader import Cleared, Removed, Stored, receive
from tests.engine.test_kv_event_publisher import wait_subscribed

BLOCK = 16


@pytest.fixture(scope="module")
def engine():
    # The endpoint picker binds one socket and every replica connects to it (llm-d's central mode). Like any
    # ZMQ subscriber it misses what is sent before its subscription arrives, so the test waits for that.
    from pagedserve import LLM

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("POD_IP", "10.9.8.7")
        llm = LLM(num_gpu_blocks_override=16, max_model_len=256, num_threads=1, max_num_seqs=4,
                  kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"})
    yield llm, Stream(sub, wait_subscribed(llm.llm_engine.core.kv_event_publisher, sub))
    llm.llm_engine.core.shutdown()
    sub.close()


class Stream:
    """Batches in sequence order, with no gap, and a router's index of the hashes they hold."""

    def __init__(self, sub, next_seq: int) -> None:
        self.sub, self.next_seq = sub, next_seq
        self.holding: set[int] = set()
        self.batches: list = []

    def take(self, quiet_s: float = 0.5) -> list:
        batches = []
        while (batch := receive(self.sub, quiet_s)) is not None:
            assert batch.seq == self.next_seq, "a gap in the sequence numbers"
            batches.append(batch)
            self.next_seq += 1
        events = [e for b in batches for e in b.events]
        for e in events:  # a router's index
            if isinstance(e, Stored):
                self.holding.update(e.hashes)
            elif isinstance(e, Removed):
                assert set(e.hashes) <= self.holding
                self.holding.difference_update(e.hashes)
        self.batches = batches
        return events


def run(llm, prompt: list[int], max_tokens: int, salt: str | None = None) -> list[int]:
    request = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
    [out] = llm.generate(request, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                         use_tqdm=False)
    return list(out.outputs[0].token_ids)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(f"kv-events-{seed}")
    return [rng.randint(300, 20000) for _ in range(n)]


def test_engine_events_rebuild_prompts_and_track_the_pool(engine):
    llm, stream = engine
    p1 = prompt(1, 40)
    out1 = run(llm, p1, 10)
    events = stream.take()
    assert all((b.pod, b.model) == ("10.9.8.7", llm.llm_engine.core.model_name) for b in stream.batches)
    stored = [e for e in events if isinstance(e, Stored)]
    # The prompt's two full blocks at prefill, the third once decoding filled it, chained by parent hash.
    assert [len(e.hashes) for e in stored] == [2, 1]
    assert stored[0].parent is None and stored[1].parent == stored[0].hashes[-1]
    assert stored[0].token_ids + stored[1].token_ids == (p1 + out1)[:3 * BLOCK]
    assert all(e.block_size == BLOCK and e.medium == "GPU" and e.extra_keys == [None] * len(e.hashes)
               for e in stored)

    salted = prompt(2, 20)
    run(llm, salted, 1, salt="acme")
    [s] = [e for e in stream.take() if isinstance(e, Stored)]
    assert s.token_ids == salted[:BLOCK] and s.extra_keys == [["acme"]]

    assert run(llm, p1, 10) == out1
    assert stream.take() == []          # a prefix hit, and a decode block the cache already holds: no news

    for seed in (3, 4, 5):              # 3 x 7 blocks through a 16-block pool: the oldest blocks go
        run(llm, prompt(seed, 100), 2)
    events = stream.take()
    removed = [h for e in events if isinstance(e, Removed) for h in e.hashes]
    assert stored[0].hashes[0] in removed and all(e.medium == "GPU" for e in events if isinstance(e, Removed))
    assert not any(isinstance(e, Cleared) for e in events)
    pool = llm.llm_engine.core.kv.pool
    assert stream.holding == {external_hash(h) for h in pool.cached}
