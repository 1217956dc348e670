"""Prefix-cache isolation: cache salts split tenants, and the hash root is private to the process."""
from __future__ import annotations

import os
import subprocess
import sys

from pagedserve.core.block_pool import PROCESS_HASH_ROOT, make_hash_root
from pagedserve.core.kv_cache_manager import KVCacheManager
from tests.core.helpers import make_request


def salted(req_id: str, salt: str | None, prompt_len: int = 10):
    req = make_request(req_id, prompt_len)
    req.cache_salt = salt
    return req


def prefill(kv: KVCacheManager, req) -> list[int]:
    hits, num_hit_tokens = kv.get_computed_blocks(req)
    kv.record_prefix_query(req, num_hit_tokens)
    kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    return kv.block_ids(req.req_id)


def test_different_salts_get_disjoint_blocks_and_no_hit():
    kv = KVCacheManager(num_blocks=10, block_size=4, hash_root=b"root")
    assert prefill(kv, salted("a", "alice")) == [0, 1, 2]
    b = salted("b", "bob")
    assert kv.get_computed_blocks(b) == ([], 0)
    assert prefill(kv, b) == [3, 4, 5]
    # Both of b's full blocks are new cache entries: the salt of block 0 is chained into block 1's hash.
    assert len(kv.pool.cached) == 4
    assert kv.prefix_stats.num_hits == 0 and kv.prefix_stats.num_queries == 20


def test_same_salt_still_shares():
    kv = KVCacheManager(num_blocks=10, block_size=4, hash_root=b"root")
    prefill(kv, salted("a", "alice"))
    b = salted("b", "alice")
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert prefill(kv, b) == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert kv.prefix_stats.num_hits == 8


def test_no_salt_and_salt_never_share_either_way():
    kv = KVCacheManager(num_blocks=12, block_size=4, hash_root=b"root")
    assert prefill(kv, salted("plain", None)) == [0, 1, 2]
    assert prefill(kv, salted("salted", "s")) == [3, 4, 5]
    assert prefill(kv, salted("plain2", None))[:2] == [0, 1]      # unsalted still shares with unsalted
    kv2 = KVCacheManager(num_blocks=12, block_size=4, hash_root=b"root")
    prefill(kv2, salted("salted", "s"))
    assert kv2.get_computed_blocks(salted("plain", None)) == ([], 0)


def test_hash_root_changes_every_block_hash():
    def hashes(root: bytes) -> list[bytes]:
        kv = KVCacheManager(num_blocks=4, block_size=4, hash_root=root)
        return kv._block_hashes(salted("a", None), 2)

    assert hashes(b"r1") == hashes(b"r1")
    assert not set(hashes(b"r1")) & set(hashes(b"r2"))
    assert KVCacheManager(num_blocks=1, block_size=4).hash_root == PROCESS_HASH_ROOT


def test_hash_root_is_random_unless_pythonhashseed_pins_it():
    assert make_hash_root(None) != make_hash_root(None)
    assert make_hash_root("random") != make_hash_root("random")
    assert make_hash_root("0") == make_hash_root("0") != make_hash_root("1")


def _process_root(seed: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    code = "from pagedserve.core.block_pool import PROCESS_HASH_ROOT; print(PROCESS_HASH_ROOT.hex())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_two_processes_have_different_roots_unless_pinned():
    assert len({_process_root(None), _process_root(None)}) == 2
    assert _process_root("42") == _process_root("42")
