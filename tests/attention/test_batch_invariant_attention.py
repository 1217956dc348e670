"""The attention kernel's batch-invariant form (kernels/csrc/attention_tile.h): a query token's output is bit for
bit the same decoded alone, verified among k + 1 speculative tokens, inside prefill chunks of any length, and
beside decode sequences that share its leading blocks (which the default merges as a shared prefix), for plain,
windowed and soft-capped layers, float32 and bf16, head sizes of the AVX-512 path (64) and the portable one (40).
Its outputs still equal the reference backend's."""
from __future__ import annotations

import random

import pytest
import torch

from pagedserve import kernels
from pagedserve.attention.reference import ReferenceAttentionBackend
from tests.paged_metadata import build_attention_metadata

ISAS = kernels.parity_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="CPU kernels could not be built here")

TOKENS, BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS = 70, 8, 8, 2  # 4 query heads per kv head: 16-token tiles of 64 rows
TARGETS = range(36, TOKENS - 3)  # past 4 shared blocks; room for 4 verified tokens
CHUNK_SIZES = (5, 16, 23)


class Sequence:
    def __init__(self, head_dim: int, dtype: torch.dtype, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q, self.k, self.v = (torch.randn(TOKENS, h, head_dim, generator=gen).to(dtype)
                                  for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
        blocks = -(-TOKENS // BLOCK_SIZE)
        ids = list(range(2 * blocks))
        random.Random(seed).shuffle(ids)
        self.table = ids[:blocks]
        self.cache = torch.zeros(2, 2 * blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim, dtype=dtype)
        slots = torch.tensor([self.table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(TOKENS)])
        self.cache[0].view(-1, NUM_KV_HEADS, head_dim)[slots] = self.k
        self.cache[1].view(-1, NUM_KV_HEADS, head_dim)[slots] = self.v
        self.scale = head_dim ** -0.5

    def attend(self, ops, spans: list[tuple[int, int]], invariant: bool, window: int, cap: float) -> torch.Tensor:
        # One call: each span [a, b) is a sequence (this one's table) whose tokens a..b-1 run now, b its length.
        # Every call writes K/V rows already in the cache, with the same values.
        meta = build_attention_metadata([(a, b - a) for a, b in spans], [self.table] * len(spans), BLOCK_SIZE)
        rows = torch.cat([torch.arange(a, b) for a, b in spans])
        return ops.paged_attention_windowed(self.q[rows], self.k[rows], self.v[rows], self.cache, meta.slot_mapping,
                                            meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale, -1,
                                            window, cap, invariant)


def outputs_by_layout(seq: Sequence, ops, invariant: bool, window: int, cap: float) -> dict[str, torch.Tensor]:
    # Each target position's output rows under every layout, keyed by layout.
    targets = list(TARGETS)
    out = {"decode": torch.stack([seq.attend(ops, [(p, p + 1)], invariant, window, cap)[0] for p in targets])}
    # k + 1 = 4 verified tokens: the target is the first, second or last row
    for row in (0, 1, 3):
        out[f"spec{row}"] = torch.stack([seq.attend(ops, [(p - row, p - row + 4)], invariant, window, cap)[row]
                                         for p in targets])
    for size in CHUNK_SIZES:
        rows = torch.cat([seq.attend(ops, [(a, min(a + size, TOKENS))], invariant, window, cap)
                          for a in range(0, TOKENS, size)])
        out[f"chunk{size}"] = rows[targets]
    # every target decoded in one call, all sharing the sequence's blocks, beside a prefill chunk
    out["shared"] = seq.attend(ops, [(p, p + 1) for p in targets] + [(10, 30)], invariant, window, cap)[:len(targets)]
    return out


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,window,cap", [(64, 0, 0.0), (40, 0, 0.0), (64, 12, 0.0), (64, 0, 5.0)])
def test_query_output_independent_of_the_batch(isa_name: str, dtype, head_dim: int, window: int, cap: float) -> None:
    ops = kernels.load_isa(isa_name)
    seq = Sequence(head_dim, dtype, seed=head_dim + window)
    got = outputs_by_layout(seq, ops, True, window, cap)
    for layout, rows in got.items():
        mismatched = [p for p, a, b in zip(TARGETS, rows, got["decode"]) if not torch.equal(a, b)]
        assert not mismatched, (layout, mismatched[:8])
    # and it is still attention: the reference backend's per-sequence prefill of the whole sequence
    ref = ReferenceAttentionBackend(window or None, cap or None)._prefill_one(
        seq.q.float(), seq.cache.float(), torch.tensor(seq.table), TOKENS, seq.scale)[list(TARGETS)]
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got["decode"].float(), ref, rtol=tol, atol=tol)
