"""The compiled attention kernel on the shapes of the models people run (head_dim 64, 96, 128 and 256; GQA
groups 1 to 8; up to 64 query heads), on each ISA variant this CPU runs (kernels.parity_isas): prefill, chunked
prefill and decode steps over blocks of 4 equal the reference backend (float32) or stay within bf16 rounding of
it (bf16), and a sequence's output does not depend on the batch around it."""
from __future__ import annotations

import pytest
import torch

from tests.attention.test_kernel_kv_dtypes import assert_within_bf16_rounding
from tests.paged_metadata import build_attention_metadata, scattered_block_tables
from pagedserve import kernels
from pagedserve.attention.cpu_paged import CpuPagedAttentionBackend
from pagedserve.attention.reference import ReferenceAttentionBackend

ops = kernels.load()
pytestmark = pytest.mark.skipif(ops is None, reason="CPU kernels could not be built here")
ISAS = kernels.parity_isas()
BLOCK_SIZE = 4

# (query heads, kv heads, head_dim): Llama-3.2-1B, Llama-3.2-3B, Qwen2.5-1.5B, Gemma-3-1B-like, a Phi-like
# (no GQA), 64 heads on 8 kv heads, GQA 8 at head_dim 256.
SHAPES = [(32, 8, 64), (24, 8, 128), (12, 2, 128), (8, 4, 256), (16, 16, 96), (64, 8, 128), (8, 1, 256)]

# Tokens per sequence in each step: prefills of 37 (tiles of 16 crossing blocks), 5, 1 and 70 tokens; then a
# 19-token chunk over the cached 37, decodes, 3- and 2-token chunks (several tokens x the group per kv head);
# then decode only.
STEPS = [[37, 5, 1, 70], [19, 1, 3, 2], [1, 1, 1, 1]]


def run_steps(backend, qs, ks, vs, cache: torch.Tensor, tables: list[list[int]]):
    # Yields (output, metadata, the step's queries) per step, all sequences of a step in one batch.
    done = [0] * len(qs)
    for step in STEPS:
        meta = build_attention_metadata([(done[i], n) for i, n in enumerate(step)], tables, BLOCK_SIZE)
        take = lambda xs: torch.cat([x[done[i]:done[i] + n] for i, (x, n) in enumerate(zip(xs, step))])  # noqa: E731
        q = take(qs)
        out = backend.forward(q, take(ks), take(vs), cache, meta, q.shape[-1] ** -0.5)
        yield out, meta, q
        done = [d + n for d, n in zip(done, step)]


def make_sequences(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(num_heads * 1000 + head_dim)
    lens = [sum(step[i] for step in STEPS) for i in range(len(STEPS[0]))]
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lens) + 6
    tables = scattered_block_tables(lens, BLOCK_SIZE, num_blocks, seed=head_dim)
    qs, ks, vs = ([torch.randn(n, h, head_dim, generator=gen).to(dtype) for n in lens]
                  for h in (num_heads, num_kv_heads, num_kv_heads))
    # Stale rows in the pool: a read outside a sequence's valid slots shows in the output.
    cache = 10 * torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    return qs, ks, vs, cache, tables


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
def test_float32_steps_equal_reference(isa_name: str, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    qs, ks, vs, cache, tables = make_sequences(num_heads, num_kv_heads, head_dim, torch.float32)
    got_cache, ref_cache = cache.clone(), cache.clone()
    kernel = run_steps(CpuPagedAttentionBackend(kernels.load_isa(isa_name)), qs, ks, vs, got_cache, tables)
    reference = run_steps(ReferenceAttentionBackend(), qs, ks, vs, ref_cache, tables)
    for step, ((got, _, _), (expected, _, _)) in enumerate(zip(kernel, reference)):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5, msg=lambda m: f"step {step}: {m}")
        assert torch.equal(got_cache, ref_cache)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
def test_bf16_steps_within_rounding(isa_name: str, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    qs, ks, vs, cache, tables = make_sequences(num_heads, num_kv_heads, head_dim, torch.bfloat16)
    backend = CpuPagedAttentionBackend(kernels.load_isa(isa_name))
    for got, meta, q in run_steps(backend, qs, ks, vs, cache, tables):
        assert got.dtype == torch.bfloat16
        assert_within_bf16_rounding(got, q, cache, meta)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 64), (64, 8, 128), (8, 4, 256)])
def test_decode_does_not_depend_on_the_batch(isa_name: str, num_heads: int, num_kv_heads: int,
                                             head_dim: int) -> None:
    # 12 decoding sequences, short contexts (a call the kernel runs on one thread) and long ones (split across
    # threads, a work item per kv head when alone): each one's output alone equals its row of the batch, bit
    # for bit.
    gen = torch.Generator().manual_seed(5)
    contexts = [3, 9, 400, 17, 250, 1, 64, 333, 5, 120, 40, 300]
    seqs = [(c, 1) for c in contexts]
    num_blocks = sum(-(-(c + 1) // BLOCK_SIZE) for c in contexts) + 4
    tables = scattered_block_tables([c + 1 for c in contexts], BLOCK_SIZE, num_blocks, seed=2)
    q, k, v = (torch.randn(len(seqs), h, head_dim, generator=gen) for h in (num_heads, num_kv_heads, num_kv_heads))
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    backend = CpuPagedAttentionBackend(kernels.load_isa(isa_name))
    batch = backend.forward(q, k, v, cache.clone(), build_attention_metadata(seqs, tables, BLOCK_SIZE),
                            head_dim ** -0.5)
    for i, seq in enumerate(seqs):
        meta = build_attention_metadata([seq], [tables[i]], BLOCK_SIZE)
        alone = backend.forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], cache.clone(), meta, head_dim ** -0.5)
        assert torch.equal(alone[0], batch[i]), f"sequence {i} (context {contexts[i]})"
