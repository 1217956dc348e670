"""KV events under load: 64 requests of 8 tenants (a shared system prompt each) through a pool small enough to
evict, with a subscriber on the ZMQ socket as a central endpoint picker would bind it.

Checks, from the messages alone: the sequence numbers have no gap; every BlockStored names new hashes and every
BlockRemoved hashes stored before (a router's index never sees an unknown block); the index rebuilt from the
stream equals the pool's cached hashes at the end; the number of removals equals the pool's eviction counter.
Then the cost: the same workload's wall time with events off and on, alternating, median of --trials each.

    python benchmarks/kv_events.py --out benchmarks/results/kv_events.json
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time

import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: llm-d's way of reading
from common import machine_info, write_json  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.core.kv_events import AllBlocksCleared, external_hash  # noqa: E402
from tests.engine.kv_event_reader import Removed, Stored, decode_message  # noqa: E402


class Subscriber(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.batches: list = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(100):
                self.batches.append(decode_message(self.sock.recv_multipart()))


def workload(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    systems = [[rng.randint(300, 20000) for _ in range(args.system_len)] for _ in range(args.tenants)]
    reqs = [(systems[i % args.tenants] + [rng.randint(300, 20000) for _ in range(args.user_len)], args.output_len)
            for i in range(args.num_requests)]
    rng.shuffle(reqs)
    return reqs


def run(llm: LLM, reqs) -> float:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    return time.perf_counter() - start


def make_llm(args, endpoint: str | None) -> LLM:
    events = None if endpoint is None else {"enable_kv_cache_events": True, "endpoint": endpoint}
    return LLM(num_gpu_blocks_override=args.num_blocks, max_num_seqs=args.num_requests, max_model_len=1024,
               num_threads=args.num_threads, kv_events_config=events)


def check_stream(llm: LLM, sub: Subscriber, first_seq: int, evictions_before: int) -> dict:
    batches = [b for b in sub.batches if b.seq >= first_seq]
    seqs = [b.seq for b in batches]
    gaps = sum(1 for a, b in zip(seqs, seqs[1:]) if b != a + 1)
    holding: set[int] = set()
    stored = removed = duplicate = unknown = 0
    for e in (e for b in batches for e in b.events):
        if isinstance(e, Stored):
            duplicate += len(holding & set(e.hashes))
            holding.update(e.hashes)
            stored += len(e.hashes)
        elif isinstance(e, Removed):
            unknown += len(set(e.hashes) - holding)
            holding.difference_update(e.hashes)
            removed += len(e.hashes)
    pool = llm.llm_engine.core.kv.pool
    cached = {external_hash(h) for h in pool.cached}
    return {"batches": len(batches), "sequence_gaps": gaps, "blocks_stored": stored, "blocks_removed": removed,
            "duplicate_stores": duplicate, "removals_of_unknown_blocks": unknown,
            "pool_evictions": pool.num_evictions - evictions_before,
            "index_equals_pool_cache": holding == cached, "pool_cached_blocks": len(cached)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-len", type=int, default=200)
    p.add_argument("--user-len", type=int, default=50)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "kv_events.json"))
    args = p.parse_args()
    reqs = workload(args)

    sub = Subscriber()
    sub.start()
    on = make_llm(args, f"tcp://127.0.0.1:{sub.port}")
    off = make_llm(args, None) if args.trials else None
    publisher = on.llm_engine.core.kv_event_publisher
    while not sub.batches:  # the subscription reaches the publisher: probes until one arrives
        publisher.publish([AllBlocksCleared()])
        time.sleep(0.05)
    time.sleep(0.2)
    first_seq = sub.batches[-1].seq + 1
    evictions_before = on.llm_engine.core.kv.pool.num_evictions
    run(on, reqs)
    time.sleep(1.0)
    correctness = check_stream(on, sub, first_seq, evictions_before)
    print(correctness)

    times = {"off": [], "on": []}
    for _ in range(args.trials):  # --trials 0: the correctness check alone (a busy machine's times mean nothing)
        for name, llm in (("off", off), ("on", on)):
            times[name].append(run(llm, reqs))
    sub.stop.set()
    result = {"machine": machine_info(), "args": vars(args), "correctness": correctness, "wall_s": times}
    if args.trials:
        result["median_wall_s"] = {k: statistics.median(v) for k, v in times.items()}
        result["on_over_off"] = result["median_wall_s"]["on"] / result["median_wall_s"]["off"]
        print(result["median_wall_s"], "on/off", round(result["on_over_off"], 3))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
