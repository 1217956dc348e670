"""GET /debug/kv's snapshot on the real engine (embedded model): exact block ids, ref counts and holders.

Block ids are predicted from the pool's free queue before each scenario: allocation takes its head, so with
the prefix cache emptied first every id below follows from the engine's rules, not from a recorded run.
"""
from __future__ import annotations

import json

import pytest

from pagedserve import SamplingParams
from pagedserve.core.kv_snapshot import build_kv_snapshot

BLOCK = 16


@pytest.fixture()
def engine(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.reset_prefix_cache()  # earlier tests' cached blocks would turn into hits
    assert engine.kv.block_size == BLOCK
    return engine


def blocks_by_id(snap):
    return {b["id"]: b for b in snap["blocks"]}


def in_use(snap):
    return {b["id"]: (b["ref_count"], b["holders"]) for b in snap["blocks"] if b["state"] == "in_use"}


def check_invariants(snap, engine):
    # Every table lists its blocks; a block's ref_count is the number of tables listing it; hashes are the pool's.
    assert snap["num_blocks"] == engine.kv.num_blocks and snap["block_size"] == BLOCK
    listed: dict[int, list[str]] = {}
    for rid, r in snap["requests"].items():
        for bid in r["block_ids"]:
            listed.setdefault(bid, []).append(rid)
    for b in snap["blocks"]:
        block = engine.kv.pool.blocks[b["id"]]
        assert b["ref_count"] == block.ref_cnt == len(b["holders"]) == len(listed.get(b["id"], []))
        assert sorted(b["holders"]) == sorted(listed.get(b["id"], []))
        assert b["hash"] == (block.block_hash[:4].hex() if block.block_hash is not None else None)
        assert b["state"] == ("in_use" if block.ref_cnt else "cached" if block.block_hash else "free")
    c = snap["counters"]
    assert c["num_in_use_blocks"] + c["num_cached_blocks"] + c["num_free_uncached_blocks"] == snap["num_blocks"]
    assert c["num_free_blocks"] == engine.kv.pool.num_free_blocks


def drain(engine):
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.take_failures()


def test_four_samples_hold_their_full_prompt_blocks_once_with_ref_count_4(engine):
    free = list(engine.kv.pool.free_queue)
    prompt = list(range(1000, 1040))  # 40 tokens: blocks 0 and 1 full, block 2 partly filled
    engine.add_request("s", {"prompt_token_ids": prompt},
                       SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True))
    engine.step()  # sample 0 computes the prompt (3 blocks); the other samples fork it
    engine.step()  # all four write token 41 into block 2: samples 1..3 copy it first
    snap = build_kv_snapshot(engine.scheduler)
    check_invariants(snap, engine)
    samples = [f"s#{i}" for i in range(4)]
    assert in_use(snap) == {free[0]: (4, samples), free[1]: (4, samples), free[2]: (1, ["s#0"]),
                            free[3]: (1, ["s#1"]), free[4]: (1, ["s#2"]), free[5]: (1, ["s#3"])}
    assert {rid: r["block_ids"] for rid, r in snap["requests"].items()} == {
        "s#0": free[:3], "s#1": [*free[:2], free[3]], "s#2": [*free[:2], free[4]], "s#3": [*free[:2], free[5]]}
    by_id = blocks_by_id(snap)
    assert by_id[free[0]]["hash"] and by_id[free[1]]["hash"]  # full prompt blocks are in the prefix cache
    c = snap["counters"]
    assert (c["num_shared_blocks"], c["num_in_use_blocks"], c["num_running"]) == (2, 6, 4)
    drain(engine)
    assert in_use(build_kv_snapshot(engine.scheduler)) == {}


def test_eight_requests_on_one_system_prompt_share_one_set_of_cached_blocks(engine):
    free = list(engine.kv.pool.free_queue)
    system = list(range(2000, 2048))  # 3 full blocks
    engine.add_request("warm", {"prompt_token_ids": system + [7, 8]}, SamplingParams(max_tokens=1))
    drain(engine)
    # warm held free[0..3]; its 3 full blocks stay cached, its partial tail block is just free. Freed blocks
    # go to the back of the queue, so new allocations take free[4], free[5], ...
    snap = build_kv_snapshot(engine.scheduler)
    check_invariants(snap, engine)
    system_ids = free[:3]
    assert [b["id"] for b in snap["blocks"] if b["state"] == "cached"] == sorted(system_ids)
    assert in_use(snap) == {} and snap["requests"] == {}
    hits_before = snap["counters"]["prefix_cache_hits"]

    ids = [f"r{i}" for i in range(8)]
    for i, rid in enumerate(ids):
        suffix = list(range(3000 + 10 * i, 3010 + 10 * i))  # 10 tokens of its own: one private block
        engine.add_request(rid, {"prompt_token_ids": system + suffix},
                           SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.step()  # all eight hit the 3 system blocks and compute only their own 10 tokens
    snap = build_kv_snapshot(engine.scheduler)
    check_invariants(snap, engine)
    expected = {bid: (8, ids) for bid in system_ids}
    expected.update({free[4 + i]: (1, [rid]) for i, rid in enumerate(ids)})
    assert in_use(snap) == expected
    assert {rid: r["block_ids"] for rid, r in snap["requests"].items()} == {
        rid: [*system_ids, free[4 + i]] for i, rid in enumerate(ids)}
    assert snap["counters"]["prefix_cache_hits"] - hits_before == 8 * 48
    assert snap["counters"]["num_shared_blocks"] == 3

    drain(engine)
    snap = build_kv_snapshot(engine.scheduler)
    check_invariants(snap, engine)
    assert in_use(snap) == {} and snap["requests"] == {}
    assert snap["counters"]["num_in_use_blocks"] == 0 and snap["counters"]["kv_cache_usage"] == 0.0
    assert {b["id"] for b in snap["blocks"] if b["state"] == "cached"} >= set(system_ids)
