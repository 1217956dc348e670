"""The compiled CPU attention kernel equals the reference backend (the oracle) and dense attention."""
from __future__ import annotations

import pytest
import torch

from tests.attention.test_paged_attention import (BLOCK_SIZE, CHUNKS, HEAD_DIM, dense_causal,
                                                  run_backend_chunks)
from tests.paged_metadata import build_attention_metadata, scattered_block_tables
from pagedserve import kernels
from pagedserve.attention.backend import get_attention_backend
from pagedserve.attention.reference import ReferenceAttentionBackend

ops = kernels.load()
pytestmark = pytest.mark.skipif(ops is None, reason="CPU kernels could not be built here")


@pytest.fixture(params=kernels.parity_isas())
def make_backend(request):
    # A backend factory on one ISA variant of the kernel: this CPU's and the portable baseline.
    from pagedserve.attention.cpu_paged import CpuPagedAttentionBackend

    variant_ops = kernels.load_isa(request.param)
    return lambda: CpuPagedAttentionBackend(variant_ops)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_kernel_matches_dense(make_backend, num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(0)
    total_lens = [sum(c) for c in CHUNKS]
    scale = HEAD_DIM ** -0.5
    qs = [torch.randn(n, num_heads, HEAD_DIM, generator=gen) for n in total_lens]
    ks = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen) for n in total_lens]
    vs = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen) for n in total_lens]
    expected = [dense_causal(q, k, v, scale) for q, k, v in zip(qs, ks, vs)]
    num_blocks = 40
    tables = scattered_block_tables(total_lens, BLOCK_SIZE, num_blocks)
    kv_cache = 100 * torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
    got = run_backend_chunks(make_backend(), qs, ks, vs, tables, kv_cache, scale)
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m: f"sequence {i}: {m}")


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 8), (40, 16)])
def test_kernel_matches_reference(make_backend, head_dim: int, block_size: int) -> None:
    # Model-like shapes: GQA group 3, query tiles of 16 crossing block edges, non-contiguous q/k/v views
    # (slices of one fused projection, as the model passes them), long contexts.
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads = 9, 3
    seqs = [(0, 37), (100, 1), (5, 1), (64, 17), (250, 1), (0, 1), (31, 2)]  # (context, query)
    lens = [c + q for c, q in seqs]
    num_blocks = sum(-(-n // block_size) for n in lens) + 8
    tables = scattered_block_tables(lens, block_size, num_blocks, seed=3)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    meta = build_attention_metadata(seqs, tables, block_size)
    n = sum(q for _, q in seqs)
    fused = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q, k, v = fused.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(n, num_heads, head_dim)
    k, v = k.view(n, num_kv_heads, head_dim), v.view(n, num_kv_heads, head_dim)
    scale = head_dim ** -0.5
    ref_cache = cache.clone()
    expected = ReferenceAttentionBackend().forward(q, k, v, ref_cache, meta, scale)
    got_cache = cache.clone()
    got = make_backend().forward(q, k, v, got_cache, meta, scale)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert torch.equal(got_cache, ref_cache)


def test_auto_backend_picks_kernel_on_cpu() -> None:
    assert get_attention_backend("auto", "cpu").name == "cpu"
    assert get_attention_backend("reference").name == "reference"


def windowed_inputs(seqs, tables, block_size, num_heads, num_kv_heads, head_dim, cache_dtype, gen):
    # A random cache over the tables' blocks, the metadata of seqs ((context, query) pairs), new q, k, v.
    num_blocks = max(max(t) for t in tables) + 1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    meta = build_attention_metadata(seqs, tables, block_size)
    n = sum(q for _, q in seqs)
    q = torch.randn(n, num_heads, head_dim, generator=gen)
    k, v = (torch.randn(n, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    return cache, meta, q, k, v


@pytest.mark.parametrize("window,softcap", [(3, None), (6, 2.0), (None, 2.0), (21, None)])
@pytest.mark.parametrize("head_dim,cache_dtype", [(8, torch.float32), (64, torch.bfloat16), (256, torch.float32)])
def test_windowed_kernel_matches_reference(make_backend, window, softcap, head_dim: int, cache_dtype) -> None:
    # Sliding windows (1 block, across blocks, wider than a tile) and Gemma 2's score cap, under chunked
    # prefill and decode with shared leading blocks (which a windowed call must not share); NaN in slots no
    # window reaches would show.
    gen = torch.Generator().manual_seed(2)
    seqs = [(0, 37), (60, 1), (60, 1), (64, 17), (5, 1), (30, 2)]  # (context, query); 1 and 2 share blocks
    lens = [c + q for c, q in seqs]
    block_size, num_heads, num_kv_heads = 4, 6, 2
    tables = scattered_block_tables(lens, block_size, sum(-(-n // block_size) for n in lens) + 4, seed=5)
    tables[2][:15] = tables[1][:15]
    cache, meta, q, k, v = windowed_inputs(seqs, tables, block_size, num_heads, num_kv_heads, head_dim, cache_dtype,
                                           gen)
    ref_cache = cache.clone()
    want = ReferenceAttentionBackend(window, softcap).forward(q, k, v, ref_cache, meta, 0.3)
    backend = make_backend().with_window(window, softcap)
    if window is not None:  # blocks outside every window: of the 81-token chunk and of the two decodes at 60
        poisoned = tables[3][:(64 - window + 1) // block_size] + tables[1][:(60 - window + 1) // block_size]
        cache[:, poisoned] = float("nan")
    got = backend.forward(q, k, v, cache, meta, 0.3)
    tol = 1e-5 if cache_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window,softcap,cache_dtype", [(19, None, torch.float32), (19, 30.0, torch.bfloat16),
                                                        (40, 0.5, torch.float32)])
def test_windowed_prefill_tiles_match_reference(make_backend, window, softcap, cache_dtype) -> None:
    # Gemma-3-1B's attention shape (4 query heads on 1 kv head, head_dim 256, blocks of 16), windows that start
    # mid-block and mid-sub-block and move inside a tile: prefill chunks of 40 and 33 tokens (tiles of 16 tokens
    # x 4 heads, the AVX-512 transposed tile; tails of 8 and 1 token, the direct one) after contexts of 50 and 0,
    # beside a decode at 70; a cap of 0.5 bends every score. NaN fills the blocks no window reaches.
    gen = torch.Generator().manual_seed(7)
    seqs = [(50, 40), (0, 33), (70, 1)]  # (context, query)
    lens = [c + q for c, q in seqs]
    block_size, num_heads, num_kv_heads, head_dim = 16, 4, 1, 256
    tables = scattered_block_tables(lens, block_size, sum(-(-n // block_size) for n in lens) + 2, seed=9)
    cache, meta, q, k, v = windowed_inputs(seqs, tables, block_size, num_heads, num_kv_heads, head_dim, cache_dtype,
                                           gen)
    want = ReferenceAttentionBackend(window, softcap).forward(q, k, v, cache.clone(), meta, head_dim ** -0.5)
    for (context, _), table in zip(seqs, tables):  # the blocks before the chunk's first row's window
        cache[:, table[:max(0, context - window + 1) // block_size]] = float("nan")
    got = make_backend().with_window(window, softcap).forward(q, k, v, cache, meta, head_dim ** -0.5)
    tol = 1e-5 if cache_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
