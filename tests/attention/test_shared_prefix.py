"""Decode sequences whose block tables start with the same blocks (prefix caching, parallel sampling) read them
once, together (kernels/csrc/paged_attention.cpp, "Shared prefixes"): which runs of sequences the kernel shares
(exact groups), and that the shared attention equals the reference backend on each ISA variant this CPU runs,
for float32, bf16 and 8-bit caches."""
from __future__ import annotations

import random

import pytest
import torch

from tests.attention.test_kernel_kv_dtypes import assert_within_bf16_rounding, filled_cache
from tests.paged_metadata import build_attention_metadata
from pagedserve import kernels
from pagedserve.attention.cpu_paged import CpuPagedAttentionBackend
from pagedserve.attention.reference import ReferenceAttentionBackend

ops = kernels.load()
pytestmark = pytest.mark.skipif(ops is None, reason="CPU kernels could not be built here")
ISAS = kernels.parity_isas()


def shared_batch(block_size: int):
    # (context, query) per sequence and its block table. Sequences of a family share their first blocks (the
    # family's prefix) and then have blocks of their own; every block id is used by one family at most.
    ids = list(range(400))
    random.Random(7).shuffle(ids)
    take = lambda n: [ids.pop() for _ in range(n)]  # noqa: E731
    bs = block_size
    seqs, tables = [], []

    def family(prefix_blocks: int, contexts: list[int], query: int = 1) -> None:
        prefix = take(prefix_blocks)
        for c in contexts:
            seqs.append((c, query))
            tables.append(prefix[:-(-(c + query) // bs)] + take(max(0, -(-(c + query) // bs) - prefix_blocks)))

    family(2, [20], query=20)                                      # 0: a prefill, alone
    family(9, [9 * bs, 9 * bs + 6, 10 * bs, 11 * bs - 1, 12 * bs + 8])  # 1-5: 9 shared blocks
    seqs.append((4 * bs, 1))                                       # 6: shares 2 blocks with 1-5: too few
    tables.append(tables[1][:2] + take(3))
    family(40, [40 * bs + i for i in range(20)])                   # 7-26: 20 sequences (2 tiles), 3 chunks
    family(5, [4 * bs, 6 * bs + 3])                                # 27-28: 4 blocks before 27's query
    family(6, [7 * bs], query=3)                                   # 29: a chunk, never shared
    family(6, [6 * bs + 2, 6 * bs + 9, 7 * bs])                    # 30-32: parallel samples of one prompt
    return seqs, tables


EXPECTED_GROUPS = [[1, 5, 9], [7, 20, 40], [27, 2, 4], [30, 3, 6]]


def test_groups_are_the_runs_that_share_blocks() -> None:
    seqs, tables = shared_batch(16)
    meta = build_attention_metadata(seqs, tables, 16)
    got = ops.shared_prefix_groups(meta.block_tables, meta.seq_lens, meta.query_start_loc, 16)
    assert got.tolist() == EXPECTED_GROUPS
    seqs8, tables8 = shared_batch(8)
    meta8 = build_attention_metadata(seqs8, tables8, 8)
    got8 = ops.shared_prefix_groups(meta8.block_tables, meta8.seq_lens, meta8.query_start_loc, 8)
    assert got8.tolist() == EXPECTED_GROUPS


def run(isa_name: str, dtype: torch.dtype, kv: str, head_dim: int, block_size: int):
    gen = torch.Generator().manual_seed(11)
    num_heads, num_kv_heads = 9, 3
    seqs, tables = shared_batch(block_size)
    meta = build_attention_metadata(seqs, tables, block_size)
    num_blocks = 400
    n = sum(q for _, q in seqs)
    q, k, v = (torch.randn(n, h, head_dim, generator=gen).to(dtype) for h in (num_heads, num_kv_heads, num_kv_heads))
    context = torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim, generator=gen)
    cache = filled_cache(kv, context, num_blocks, block_size)
    got_cache = cache.clone()
    got = CpuPagedAttentionBackend(kernels.load_isa(isa_name)).forward(q, k, v, got_cache, meta, head_dim ** -0.5)
    return q, meta, got, got_cache, cache


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (40, 8)])
def test_shared_prefix_float32_equals_reference(isa_name: str, head_dim: int, block_size: int) -> None:
    q, meta, got, got_cache, cache = run(isa_name, torch.float32, "float32", head_dim, block_size)
    ref_cache = cache.clone()
    k, v = got_cache.flatten(1, 2)[:, meta.slot_mapping]  # this step's rows, as the kernel wrote them
    expected = ReferenceAttentionBackend().forward(q, k, v, ref_cache, meta, head_dim ** -0.5)
    assert torch.equal(got_cache, ref_cache)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("kv", ["bfloat16", "int8", "fp8_e4m3"])
def test_shared_prefix_bf16_close_to_float32(isa_name: str, kv: str) -> None:
    # Within the bf16 roundings of the output and (AMX) the weights, as the prefill tiles.
    q, meta, got, got_cache, _ = run(isa_name, torch.bfloat16, kv, 64, 16)
    assert_within_bf16_rounding(got, q, got_cache, meta)
