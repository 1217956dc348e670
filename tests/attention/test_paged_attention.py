"""Paged attention (block_size 4, scattered blocks, chunked prefill, decode) equals dense causal SDPA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.paged_metadata import build_attention_metadata, chunk_schedule, scattered_block_tables
from pagedserve.attention.backend import get_attention_backend

BLOCK_SIZE = 4
HEAD_DIM = 8
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]

# Per sequence, the tokens it runs in each step. Step 0 mixes prefills of different lengths (crossing block
# boundaries) with a 1-token prompt; step 1 mixes chunked prefill with decode; the tail is pure decode.
CHUNKS = [
    [5, 1, 1, 1],
    [9, 4, 1, 1],
    [1, 1, 1, 1],
    [3, 3, 3, 1],
    [4, 1, 1],
]


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q [L, Hq, D], k/v [L, Hkv, D] -> [L, Hq, D], K/V heads repeated explicitly (no enable_gqa).
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                       scale=scale)
    return o.transpose(0, 1)


def run_backend_chunks(backend, qs, ks, vs, tables, kv_cache, scale: float, device: str = "cpu") -> list[torch.Tensor]:
    # Runs each sequence's q/k/v through `backend` step by step as CHUNKS schedules them, all sequences of a
    # step in one flattened batch; returns per-sequence outputs (NaN where a position never ran).
    got = [torch.full_like(q, float("nan")) for q in qs]
    for step in chunk_schedule(CHUNKS):
        meta = build_attention_metadata([(c, q) for _, c, q in step], [tables[i] for i, _, _ in step], BLOCK_SIZE,
                                        device=device)
        q = torch.cat([qs[i][c:c + n] for i, c, n in step])
        k = torch.cat([ks[i][c:c + n] for i, c, n in step])
        v = torch.cat([vs[i][c:c + n] for i, c, n in step])
        out = backend.forward(q, k, v, kv_cache, meta, scale)
        assert out.shape == q.shape
        at = 0
        for i, c, n in step:
            got[i][c:c + n] = out[at:at + n]
            at += n
    return got


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("device", DEVICES)
def test_paged_matches_dense(num_heads: int, num_kv_heads: int, seed: int, device: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    total_lens = [sum(c) for c in CHUNKS]
    scale = HEAD_DIM ** -0.5
    qs = [torch.randn(n, num_heads, HEAD_DIM, generator=gen) for n in total_lens]
    ks = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen) for n in total_lens]
    vs = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen) for n in total_lens]
    qs, ks, vs = ([t.to(device) for t in ts] for ts in (qs, ks, vs))
    expected = [dense_causal(q, k, v, scale) for q, k, v in zip(qs, ks, vs)]

    num_blocks = 40
    tables = scattered_block_tables(total_lens, BLOCK_SIZE, num_blocks, seed=seed)
    # Stale garbage in the pool: anything read outside a sequence's valid slots would show up.
    kv_cache = 100 * torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen).to(device)
    got = run_backend_chunks(get_attention_backend("reference"), qs, ks, vs, tables, kv_cache, scale, device)
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m: f"sequence {i}: {m}")


def test_kv_written_at_slots() -> None:
    num_kv_heads, num_blocks = 2, 6
    kv_cache = torch.zeros(2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    meta = build_attention_metadata([(2, 3)], [[5, 1]], BLOCK_SIZE)  # positions 2,3 in block 5; 4 in block 1
    k, v = torch.randn(3, num_kv_heads, HEAD_DIM), torch.randn(3, num_kv_heads, HEAD_DIM)
    get_attention_backend().forward(torch.randn(3, 4, HEAD_DIM), k, v, kv_cache, meta, 1.0)
    torch.testing.assert_close(kv_cache[0, 5, 2:4], k[:2])
    torch.testing.assert_close(kv_cache[0, 1, 0], k[2])
    torch.testing.assert_close(kv_cache[1, 1, 0], v[2])
    assert kv_cache[:, 5, :2].abs().sum() == 0 and kv_cache[:, 1, 1:].abs().sum() == 0


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="reference"):
        get_attention_backend("nope")


def dense_windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    # Query position p sees keys p - window + 1 .. p, written out over the whole sequence.
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    pos = torch.arange(q.shape[0])
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                       scale=scale)
    return o.transpose(0, 1)


@pytest.mark.parametrize("window", [1, 3, 6])
def test_sliding_window_matches_dense(window: int) -> None:
    from pagedserve.attention.reference import ReferenceAttentionBackend

    gen = torch.Generator().manual_seed(window)
    total_lens = [sum(c) for c in CHUNKS]
    qs = [torch.randn(n, 4, HEAD_DIM, generator=gen) for n in total_lens]
    ks = [torch.randn(n, 2, HEAD_DIM, generator=gen) for n in total_lens]
    vs = [torch.randn(n, 2, HEAD_DIM, generator=gen) for n in total_lens]
    tables = scattered_block_tables(total_lens, BLOCK_SIZE, 40, seed=window)
    kv_cache = 100 * torch.randn(2, 40, BLOCK_SIZE, 2, HEAD_DIM, generator=gen)
    got = run_backend_chunks(ReferenceAttentionBackend(sliding_window=window), qs, ks, vs, tables, kv_cache, 0.3)
    for i, (g, q, k, v) in enumerate(zip(got, qs, ks, vs)):
        torch.testing.assert_close(g, dense_windowed(q, k, v, 0.3, window), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"sequence {i}: {m}")


def test_sliding_window_reads_only_blocks_in_the_window() -> None:
    # 40 cached tokens, window 6, blocks of 4: a decode at position 40 sees keys 35..40 and a chunk at
    # positions 36..40 sees keys 31..40, so blocks 0..6 (positions 0..27) are never read: NaN there would
    # make every output NaN.
    from pagedserve.attention.reference import ReferenceAttentionBackend

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(41, h, HEAD_DIM, generator=gen) for h in (4, 2, 2))
    table = list(range(11))
    backend = ReferenceAttentionBackend(sliding_window=6)
    want = dense_windowed(q, k, v, 0.3, 6)
    for context, q_len in ((40, 1), (36, 5)):
        kv_cache = torch.zeros(2, 11, BLOCK_SIZE, 2, HEAD_DIM)
        kv_cache[0].view(-1, 2, HEAD_DIM)[:41], kv_cache[1].view(-1, 2, HEAD_DIM)[:41] = k, v
        kv_cache[:, :7] = float("nan")
        meta = build_attention_metadata([(context, q_len)], [table], BLOCK_SIZE)
        s = slice(context, context + q_len)
        got = backend.forward(q[s], k[s], v[s], kv_cache, meta, 0.3)
        torch.testing.assert_close(got, want[s], atol=1e-5, rtol=1e-5)
