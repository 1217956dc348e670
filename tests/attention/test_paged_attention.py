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
