"""The prefix cache's disk tier without a model: file format and checks, LRU bound, and the KV manager's loads."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_disk import DiskKVStore, DiskRecord, make_disk_hash_root, model_fingerprint
from pagedserve.core.kv_events import BlockRemoved, BlockStored, KVEventCollector, external_hash
from tests.core.helpers import make_request

NBYTES = 64
ROOT = make_disk_hash_root("test-model", dtype="float32", block_size=4)


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(NBYTES))


def record(block_hash: bytes) -> DiskRecord:
    return DiskRecord(0, block_hash, None, (1, 2, 3, 4), None)


def run_prompt(kv: KVCacheManager, req) -> None:
    hits, _ = kv.get_computed_blocks(req)
    kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens - len(hits) * kv.block_size, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)


def write_stores(kv: KVCacheManager) -> list[int]:
    # What the worker does after a step: each newly cached block's bytes go to the writer (here: its id's).
    stores = kv.take_disk_stores()
    for rec in stores:
        kv.disk.store(rec, payload(rec.block_id))
    kv.disk.flush()
    return [rec.block_id for rec in stores]


def test_second_manager_loads_the_prefix_from_disk(tmp_path):
    a = KVCacheManager(num_blocks=10, block_size=4, disk=DiskKVStore(str(tmp_path), None, NBYTES, ROOT))
    req = make_request("a", prompt_len=10)
    run_prompt(a, req)
    assert write_stores(a) == [0, 1]                 # the two full blocks; the third is partial
    # A fresh manager (a restarted engine) on the same directory, whose free queue starts elsewhere.
    b = KVCacheManager(num_blocks=10, block_size=4, disk=DiskKVStore(str(tmp_path), None, NBYTES, ROOT))
    b.pool.allocate(3)
    req = make_request("b", prompt_len=12)           # the same 10 tokens and 2 more
    hits, num_hit_tokens = b.get_computed_blocks(req)
    assert hits == [] and num_hit_tokens == 8
    assert b.allocate_slots(req, 4, hits) == [3, 4, 5]
    ops = b.take_block_ops()
    assert [(block_id, bytes(data)) for block_id, data in ops.load] == [(3, payload(0)), (4, payload(1))]
    assert b.disk.stats.num_loaded_blocks == 2 and b.disk.stats.num_hit_tokens == 8
    # Loaded blocks are cached in the pool at once and are not written back.
    assert b.get_computed_blocks(make_request("c", prompt_len=12))[1] == 8
    req.num_computed_tokens = 12
    b.cache_blocks(req)
    assert [rec.block_id for rec in b.take_disk_stores()] == [5]


def test_salted_and_unsalted_prefixes_do_not_meet_on_disk(tmp_path):
    a = KVCacheManager(num_blocks=10, block_size=4, disk=DiskKVStore(str(tmp_path), None, NBYTES, ROOT))
    req = make_request("a", prompt_len=9)
    req.cache_salt = "tenant-1"
    run_prompt(a, req)
    write_stores(a)
    b = KVCacheManager(num_blocks=10, block_size=4, disk=DiskKVStore(str(tmp_path), None, NBYTES, ROOT))
    assert b.get_computed_blocks(make_request("b", prompt_len=9))[1] == 0
    salted = make_request("c", prompt_len=9)
    salted.cache_salt = "tenant-1"
    assert b.get_computed_blocks(salted)[1] == 8


def test_a_short_pool_reads_no_more_blocks_than_it_can_take_and_keeps_them(tmp_path):
    a = KVCacheManager(num_blocks=10, block_size=4, disk=DiskKVStore(str(tmp_path), None, NBYTES, ROOT))
    run_prompt(a, make_request("a", prompt_len=17))
    write_stores(a)                                  # 4 full blocks on disk
    b = KVCacheManager(num_blocks=5, block_size=4, disk=DiskKVStore(str(tmp_path), None, NBYTES, ROOT))
    taken = b.pool.allocate(3)
    reads = []
    load = b.disk.load
    b.disk.load = lambda h: reads.append(h) or load(h)
    req = make_request("b", prompt_len=17)
    assert b.get_computed_blocks(req) == ([], 8)    # 2 free blocks: 2 of the 4 on disk are read
    assert b.allocate_slots(req, 9, []) is None     # and the 3 more it needs are not there
    assert b.take_block_ops().load == [] and b.disk.stats.num_loaded_blocks == 0
    # The next try, with the pool free: the two blocks read before are not read again.
    b.pool.free(taken)
    assert b.get_computed_blocks(req) == ([], 16)
    assert reads == b.req_hashes["b"][:4]
    assert b.allocate_slots(req, 1, []) == [3, 4, 0, 1, 2]
    assert [(i, bytes(p)) for i, p in b.take_block_ops().load] == [(3, payload(0)), (4, payload(1)),
                                                                   (0, payload(2)), (1, payload(3))]


def test_writer_reads_pinned_blocks_from_the_pool_and_drops_stores_past_the_bound_unread(tmp_path):
    # With the pool in host memory the writer reads a block's K/V straight from it: the block stays pinned
    # (allocation skips it, usage() does not count it, prefix hits may take it) until the writer is done.
    kv = KVCacheManager(num_blocks=10, block_size=4, disk=DiskKVStore(str(tmp_path), None, NBYTES, ROOT))
    kv.max_disk_pins = 2
    memory = [bytearray(payload(i)) for i in range(10)]   # the pool; a block is two pieces (K, V)
    reads = []

    def views(block_ids):
        reads.extend(block_ids)
        return [[memoryview(memory[b])[:NBYTES // 2], memoryview(memory[b])[NBYTES // 2:]] for b in block_ids]

    started, gate = threading.Event(), threading.Event()
    write = kv.disk._write
    kv.disk._write = lambda *a: (started.set(), gate.wait(30), write(*a))
    req = make_request("a", prompt_len=13)                # blocks 0-2 full, 3 partial
    run_prompt(kv, req)
    hashes = kv.req_hashes["a"][:3]
    kv.write_disk_stores(views, pin=True)
    assert reads == [0, 1] and kv.disk.stats.num_dropped_stores == 1  # block 2 dropped before any read
    kv.free(req)
    assert kv.pool.num_free_blocks == 8 and kv.usage() == 0.0
    hit = make_request("b", prompt_len=13)                # a prefix hit takes the pinned blocks
    hits, _ = kv.get_computed_blocks(hit)
    assert [b.block_id for b in hits] == [0, 1, 2]
    kv.allocate_slots(hit, 1, hits)
    kv.free(hit)
    assert kv.pool.num_free_blocks == 8 and kv.usage() == 0.0
    assert sorted(b.block_id for b in kv.pool.allocate(8)) == list(range(2, 10))
    started.wait(30)                                      # the writer is on block 0, block 1 waits
    kv.release_disk_pins()
    assert kv.pool.num_free_blocks == 0 and kv.usage() == 0.8
    # Pins yield to requests: a request short of a block takes block 1, whose store is dropped unwritten.
    assert kv.allocate_slots(make_request("c", prompt_len=3, first_token=500), 3) == [1]
    assert kv.disk.stats.num_dropped_stores == 2 and kv.num_disk_pins == 1
    gate.set()
    kv.disk.flush()
    kv.release_disk_pins()
    assert list(kv.pool.free_queue) == [0] and kv.num_disk_pins == 0
    assert bytes(kv.disk.load(hashes[0])) == payload(0)
    assert kv.disk.load(hashes[1]) is None and kv.disk.load(hashes[2]) is None


def test_corrupt_torn_and_foreign_files_are_misses(tmp_path):
    store = DiskKVStore(str(tmp_path), None, NBYTES, ROOT)
    hashes = [bytes([i]) * 32 for i in range(4)]
    for i, h in enumerate(hashes):
        store.store(record(h), payload(i))
    store.flush()
    assert bytes(store.load(hashes[0])) == payload(0)
    with open(store.path(hashes[1]), "r+b") as f:   # one flipped bit in the K/V
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    with open(store.path(hashes[2]), "r+b") as f:   # a torn write
        f.truncate(40)
    os.replace(store.path(hashes[3]), store.path(hashes[0]))  # a file under another block's name
    assert [store.load(h) for h in hashes] == [None] * 4
    assert store.stats.num_corrupt_blocks == 3 and not os.path.exists(store.path(hashes[1]))
    store.store(record(hashes[1]), payload(1))               # recomputed and written again
    store.flush()
    assert bytes(store.load(hashes[1])) == payload(1)


def test_byte_bound_evicts_least_recently_used_files(tmp_path):
    file_bytes = NBYTES + 52
    store = DiskKVStore(str(tmp_path), 4 * file_bytes, NBYTES, ROOT)
    hashes = [bytes([i]) * 32 for i in range(6)]
    for i, h in enumerate(hashes[:4]):
        store.store(record(h), payload(i))
        store.flush()
        os.utime(store.path(h), (1000 + i, 1000 + i))  # written in order, a second apart
    assert store.load(hashes[0]) is not None       # read: now the most recently used
    store.store(record(hashes[4]), payload(4))               # 5 files > 4: evict down to 90% (3 files)
    store.flush()
    assert [os.path.exists(store.path(h)) for h in hashes[:5]] == [True, False, False, True, True]
    assert store.stats.num_evicted_blocks == 2 and store.stats.disk_bytes == 3 * file_bytes
    # A fresh store counts what is already there (another replica's or an earlier run's files).
    assert DiskKVStore(str(tmp_path), None, NBYTES, ROOT).stats.disk_bytes == 3 * file_bytes


def test_hash_root_is_the_same_in_another_process(tmp_path):
    # Not Python's hash(): a restarted engine (another PYTHONHASHSEED) derives the same root.
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(3 << 20))
    code = ("import sys; from pagedserve.core.kv_disk import make_disk_hash_root, model_fingerprint;"
            "print(make_disk_hash_root(model_fingerprint(sys.argv[1]), dtype='bfloat16').hex())")
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    out = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, check=True,
                         env=env)
    assert out.stdout.strip() == make_disk_hash_root(model_fingerprint(str(model)), dtype="bfloat16").hex()
    assert make_disk_hash_root(model_fingerprint(str(model)), dtype="float32").hex() != out.stdout.strip()
    with open(model, "r+b") as f:                    # another model: one changed byte in the middle
        f.seek(3 << 19)
        f.write(b"\x00\x01")
    assert make_disk_hash_root(model_fingerprint(str(model)), dtype="bfloat16").hex() != out.stdout.strip()


def test_bound_smaller_than_a_block_and_unusable_directories_are_refused(tmp_path):
    with pytest.raises(ValueError, match="kv-offload-max-bytes"):
        DiskKVStore(str(tmp_path), NBYTES, NBYTES, ROOT)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="kv-offload-dir .*cannot create"):
        DiskKVStore(str(tmp_path / "file" / "kv"), None, NBYTES, ROOT)


def test_disk_writes_loads_and_evictions_are_kv_events(tmp_path):
    events = KVEventCollector(block_size=4)
    a = KVCacheManager(num_blocks=10, block_size=4, kv_events=events,
                       disk=DiskKVStore(str(tmp_path), 3 * (NBYTES + 52), NBYTES, ROOT))
    req = make_request("a", prompt_len=10)
    req.cache_salt = "s"
    run_prompt(a, req)
    h0, h1 = a.req_hashes["a"][:2]
    write_stores(a)
    gpu, *disk = events.take()
    assert gpu.medium == "GPU" and gpu.block_hashes == (external_hash(h0), external_hash(h1))
    # in the order the writes finish: the writer thread and flush() write queued blocks side by side
    assert sorted(disk, key=lambda e: e.block_hashes != (external_hash(h0),)) == [
        BlockStored((external_hash(h0),), None, tuple(req.prompt_token_ids[:4]), 4, "DISK", (("s",),)),
        BlockStored((external_hash(h1),), external_hash(h0), tuple(req.prompt_token_ids[4:8]), 4, "DISK", (None,))]
    # A restarted engine loads both: its pool reports them as stored, like blocks it computed.
    b = KVCacheManager(num_blocks=10, block_size=4, kv_events=events,
                       disk=DiskKVStore(str(tmp_path), 3 * (NBYTES + 52), NBYTES, ROOT))
    again = make_request("b", prompt_len=10)
    again.cache_salt = "s"
    hits, _ = b.get_computed_blocks(again)
    b.allocate_slots(again, 2, hits)
    assert events.take() == [BlockStored((external_hash(h0), external_hash(h1)), None,
                                         tuple(req.prompt_token_ids[:8]), 4, "GPU", (("s",), None))]
    # Two more blocks on disk: 4 files over a bound of 3, the two least recently used go.
    for h in (h0, h1):
        os.utime(b.disk.path(h), (1000, 1000))
    run_prompt(a, make_request("c", prompt_len=8, first_token=500))
    write_stores(a)
    removed = [e for e in events.take() if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(map(external_hash, (h0, h1)))
    assert {e.medium for e in removed} == {"DISK"}


def test_replicas_writing_one_directory_at_once(tmp_path):
    # Two engines' writers race on the same blocks: every file ends whole, no temporary file is left.
    stores = [DiskKVStore(str(tmp_path), None, NBYTES, ROOT) for _ in range(2)]
    hashes = [bytes([i]) * 32 for i in range(40)]
    for store in stores:
        for i, h in enumerate(hashes):
            store.store(record(h), payload(i))
    for store in stores:
        store.flush()
    assert [bytes(stores[i % 2].load(h)) for i, h in enumerate(hashes)] == [payload(i) for i in range(40)]
    assert sorted(p.suffix for p in tmp_path.rglob("*") if p.is_file()) == [".kv"] * 40
    assert sum(s.stats.num_stored_blocks for s in stores) >= 40


def test_blocks_queued_at_exit_reach_the_disk(tmp_path):
    # An offline LLM has no shutdown: the interpreter's exit waits for the writer (here a slow one).
    code = f"""
import time
from pagedserve.core.kv_disk import DiskKVStore, DiskRecord
store = DiskKVStore({str(tmp_path)!r}, None, 4, b"r" * 32)
write = store._write
store._write = lambda *a: (time.sleep(0.1), write(*a))
for i in range(3):
    store.store(DiskRecord(0, bytes([i]) * 32, None, (), None), b"abcd")
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert len(list(tmp_path.rglob("*.kv"))) == 3


def test_writer_takes_idle_cpu_and_flush_writes_what_it_has_not_started(tmp_path):
    # The writer thread runs at SCHED_IDLE (a niceness-19 thread still took its share of a busy core from the
    # steps' OpenMP threads). So it may get no CPU for long: a thread waiting in flush writes the queue itself.
    store = DiskKVStore(str(tmp_path), None, NBYTES, ROOT)
    started, gate, writers = threading.Event(), threading.Event(), {}
    write = store._write

    def stalled_writer(rec, chunks):  # the writer thread gets its first block and then no CPU
        writers[rec.block_hash] = threading.current_thread()
        if threading.current_thread() is store._thread:
            started.set()
            gate.wait(30)
        write(rec, chunks)

    store._write = stalled_writer
    hashes = [bytes([i]) * 32 for i in range(4)]
    for h in hashes:
        store.store(record(h), payload(h[0]))
    assert started.wait(30)
    if hasattr(os, "SCHED_IDLE"):
        assert os.sched_getscheduler(store._thread.native_id) == os.SCHED_IDLE
    assert not store.flush(timeout=0.2)                # the writer's own block is still in flight
    assert [writers.get(h) for h in hashes] == [store._thread] + [threading.current_thread()] * 3
    assert [bytes(store.load(h)) for h in hashes[1:]] == [payload(h[0]) for h in hashes[1:]]
    gate.set()
    assert store.flush(timeout=30)
    assert bytes(store.load(hashes[0])) == payload(0) and store.stats.num_stored_blocks == 4
