"""The compiled attention kernel on low-precision data, on each ISA variant this CPU runs (kernels.parity_isas):
8-bit caches (int8, fp8 e4m3) read directly equal the reference backend, which dequantizes with torch; rows the
kernel quantizes equal kv_quant.quantize's within one code; every 8-bit code decodes exactly; bf16 queries and
caches stay within bf16 rounding of a float32 reference, also through the prefill tiles (the amx variant's AMX
path: bf16 queries on bf16 and 8-bit caches, more than 4 query rows per kv head)."""
from __future__ import annotations

import pytest
import torch

from tests.paged_metadata import build_attention_metadata, scattered_block_tables
from pagedserve import kernels
from pagedserve.attention import kv_quant
from pagedserve.attention.cpu_paged import CpuPagedAttentionBackend
from pagedserve.attention.reference import ReferenceAttentionBackend, write_kv

ops = kernels.load()
pytestmark = pytest.mark.skipif(ops is None, reason="CPU kernels could not be built here")
ISAS = kernels.parity_isas()
KV_8BIT = ["int8", "fp8_e4m3"]
# (context, query) per sequence: prefill, long decodes, a chunk crossing blocks, a 1-token prompt, a 2-token chunk.
SEQS = [(0, 37), (100, 1), (5, 1), (64, 17), (250, 1), (0, 1), (31, 2)]


def make_batch(head_dim: int, block_size: int, dtype: torch.dtype, seed: int):
    # GQA (9 query heads on 3 kv heads), scattered block tables with unused blocks between them, q/k/v as
    # slices of one fused projection (non-contiguous, as the model passes them).
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = 9, 3
    lens = [c + q for c, q in SEQS]
    num_blocks = sum(-(-n // block_size) for n in lens) + 8
    tables = scattered_block_tables(lens, block_size, num_blocks, seed=seed)
    meta = build_attention_metadata(SEQS, tables, block_size)
    n = sum(q for _, q in SEQS)
    fused = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = fused.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    context = torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim, generator=gen)
    return (q.view(n, num_heads, head_dim), k.view(n, num_kv_heads, head_dim), v.view(n, num_kv_heads, head_dim),
            context, meta, num_blocks)


def filled_cache(kv: str, context: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    # Every slot holds a context row written by the reference path, so stale slots hold data too.
    dtype = kv_quant.storage_dtype(kv)
    num_kv_heads, head_dim = context.shape[-2:]
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, kv_quant.row_width(dtype, head_dim), dtype=dtype)
    write_kv(cache, context[0], context[1], torch.arange(num_blocks * block_size))
    return cache


def as_float(cache: torch.Tensor) -> torch.Tensor:
    return kv_quant.dequantize(cache, torch.float32) if kv_quant.is_quantized(cache.dtype) else cache.float()


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("kv", KV_8BIT)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (40, 8)])
def test_kernel_reads_8bit_cache_like_reference(isa_name: str, kv: str, head_dim: int, block_size: int) -> None:
    q, k, v, context, meta, num_blocks = make_batch(head_dim, block_size, torch.float32, seed=1)
    cache = filled_cache(kv, context, num_blocks, block_size)
    backend = CpuPagedAttentionBackend(kernels.load_isa(isa_name))
    got_cache, ref_cache = cache.clone(), cache.clone()
    got = backend.forward(q, k, v, got_cache, meta, head_dim ** -0.5)
    ReferenceAttentionBackend().forward(q, k, v, ref_cache, meta, head_dim ** -0.5)

    # Written rows: the kernel's quantization equals torch's within one code (x / scale may round differently
    # in the last bit at a tie); one code is at most amax / 127 (int8) or 1/16 of the value (fp8, 3 bits).
    written = meta.slot_mapping
    got_rows = as_float(got_cache).flatten(1, 2)[:, written]
    ref_rows = as_float(ref_cache).flatten(1, 2)[:, written]
    step = ref_rows.abs().amax(-1, keepdim=True) / 127 if kv == "int8" else ref_rows.abs() / 8
    assert ((got_rows - ref_rows).abs() <= step * 1.001 + 1e-6).all()
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(got_cache.view(torch.uint8).flatten(1, 2)[:, untouched],
                       cache.view(torch.uint8).flatten(1, 2)[:, untouched])

    # Reading: the reference over the cache the kernel wrote (its rows re-quantize to the same codes).
    num_kv_heads = k.shape[1]
    k_written, v_written = got_rows[0].view(-1, num_kv_heads, head_dim), got_rows[1].view(-1, num_kv_heads, head_dim)
    expected = ReferenceAttentionBackend().forward(q, k_written, v_written, got_cache.clone(), meta, head_dim ** -0.5)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("kv", KV_8BIT)
def test_every_8bit_code_decodes_exactly(isa_name: str, kv: str) -> None:
    # One cached token whose value row holds every code (fp8: all but the two NaNs, subnormals included) and
    # a new token with zero key and value: all scores are 0, so the output is exactly half the cached value.
    dtype = kv_quant.storage_dtype(kv)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if kv == "fp8_e4m3":
        codes = codes[(codes & 0x7F) != 0x7F]
    head_dim = 256
    codes = torch.cat((codes, torch.zeros(head_dim - len(codes), dtype=torch.uint8)))
    scale = torch.tensor([0.37], dtype=torch.float32).view(torch.uint8)
    cache = torch.zeros(2, 1, 2, 1, head_dim + 4, dtype=torch.uint8)
    cache[1, 0, 0, 0] = torch.cat((codes, scale))
    cache[0, 0, 0, 0, head_dim:] = scale  # key codes 0
    cache = cache.view(dtype)
    meta = build_attention_metadata([(1, 1)], [[0]], 2)
    zeros = torch.zeros(1, 1, head_dim)
    got = CpuPagedAttentionBackend(kernels.load_isa(isa_name)).forward(torch.randn(1, 1, head_dim), zeros, zeros,
                                                                       cache, meta, 1.0)
    expected = kv_quant.dequantize(cache[1, 0, 0, 0], torch.float32)
    assert torch.equal(got[0, 0] * 2, expected)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("kv", ["bfloat16", "int8", "float32"])
def test_bf16_queries_close_to_float32(isa_name: str, kv: str) -> None:
    head_dim, block_size = 64, 16
    q, k, v, context, meta, num_blocks = make_batch(head_dim, block_size, torch.bfloat16, seed=2)
    cache = filled_cache(kv, context, num_blocks, block_size)
    got_cache = cache.clone()
    got = CpuPagedAttentionBackend(kernels.load_isa(isa_name)).forward(q, k, v, got_cache, meta, head_dim ** -0.5)
    assert got.dtype == torch.bfloat16
    # float32 arithmetic on the same (bf16-exact) inputs and cache contents; the output's rounding to bf16
    # (8 bits) is the expected difference.
    expected = ReferenceAttentionBackend().forward(q.float(), k.float(), v.float(), cache.clone(), meta,
                                                   head_dim ** -0.5)
    torch.testing.assert_close(got.float(), expected, atol=1e-2 if kv == "int8" else 4e-3, rtol=2 ** -8)
    if kv != "int8":  # bf16 rows are stored exactly
        written = meta.slot_mapping
        assert torch.equal(got_cache.flatten(1, 2)[0, written].float(), k.float())


# Prefill-shaped batches: chunks over cached prefixes (a long one, as a shared system prompt), query lengths
# that are not multiples of the 16-token tile, 2 to 5 tokens (a few query rows per kv head), decodes between.
PREFILL_SEQS = [(0, 45), (300, 23), (17, 16), (0, 5), (90, 1), (33, 2), (0, 1), (150, 64)]


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("kv", ["bfloat16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (8, 2, 128, 8), (4, 4, 32, 5), (6, 1, 64, 32)])
def test_bf16_prefill_tiles_close_to_float32(isa_name: str, kv: str, num_heads: int, num_kv_heads: int,
                                             head_dim: int, block_size: int) -> None:
    q, k, v, cache, meta = prefill_batch(PREFILL_SEQS, kv, num_heads, num_kv_heads, head_dim, block_size, seed=4)
    got_cache = cache.clone()
    got = CpuPagedAttentionBackend(kernels.load_isa(isa_name)).forward(q, k, v, got_cache, meta, head_dim ** -0.5)
    assert_within_bf16_rounding(got, q, got_cache, meta)


def prefill_batch(seqs: list[tuple[int, int]], kv: str, num_heads: int, num_kv_heads: int, head_dim: int,
                  block_size: int, seed: int, spread: float = 1.0):
    # Sequences of (cached, new) tokens over scattered blocks; queries and new K/V of std `spread` (bf16, float32
    # for a float32 cache), a cache full of context rows.
    gen = torch.Generator().manual_seed(seed)
    lens = [c + q for c, q in seqs]
    num_blocks = sum(-(-n // block_size) for n in lens) + 8
    meta = build_attention_metadata(seqs, scattered_block_tables(lens, block_size, num_blocks, seed=seed),
                                    block_size)
    n = sum(q for _, q in seqs)
    dtype = torch.float32 if kv == "float32" else torch.bfloat16
    q, k, v = (torch.randn(n, h, head_dim, generator=gen).mul(spread).to(dtype)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    cache = filled_cache(kv, torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim, generator=gen),
                         num_blocks, block_size)
    return q, k, v, cache, meta


# Long prompts and chunks (the AMX tiles walk keys in chunks of 32, over many blocks, rows whose maximum moves late),
# on real shapes: Llama-3.2-1B, Qwen2.5-1.5B, SmolLM2 with blocks of 24 (sub-blocks of 16 and 8), GQA 6 at blocks
# of 16; a 200-token chunk over 300 cached tokens, a 261-token prompt, a decode beside them.
LONG_SEQS = [(300, 200), (0, 261), (400, 1)]


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size",
                         [(32, 8, 64, 16), (12, 2, 128, 16), (9, 3, 64, 24), (24, 4, 64, 16)])
def test_long_prefill_close_to_float32(isa_name: str, kv: str, num_heads: int, num_kv_heads: int, head_dim: int,
                                       block_size: int) -> None:
    q, k, v, cache, meta = prefill_batch(LONG_SEQS, kv, num_heads, num_kv_heads, head_dim, block_size, seed=5,
                                         spread=2.0)
    got_cache = cache.clone()
    got = CpuPagedAttentionBackend(kernels.load_isa(isa_name)).forward(q, k, v, got_cache, meta, head_dim ** -0.5)
    if kv != "float32":
        assert_within_bf16_rounding(got, q, got_cache, meta)
        return
    ref_cache = cache.clone()
    expected = ReferenceAttentionBackend().forward(q, k, v, ref_cache, meta, head_dim ** -0.5)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert torch.equal(got_cache, ref_cache)


def assert_within_bf16_rounding(got: torch.Tensor, q: torch.Tensor, got_cache: torch.Tensor, meta) -> None:
    # float32 arithmetic on the cache the kernel wrote (8-bit rows as it quantized them). The expected difference:
    # the output's rounding to bf16 (2^-9 of |out|) and, on AMX, the weights' (2^-9 of each p_j, so at most 2^-9
    # of sum_j p_j |v_j|: the same attention over |v|); twice that is the bound.
    n, head_dim = q.shape[0], q.shape[-1]
    written = as_float(got_cache).flatten(1, 2)[:, meta.slot_mapping].view(2, n, got_cache.shape[3], head_dim)
    reference = ReferenceAttentionBackend()
    expected = reference.forward(q.float(), written[0], written[1], got_cache.clone(), meta, head_dim ** -0.5)
    abs_values = as_float(got_cache)
    abs_values[1].abs_()
    magnitude = reference.forward(q.float(), written[0], written[1].abs(), abs_values, meta, head_dim ** -0.5)
    assert ((got.float() - expected).abs() <= 2 ** -8 * (magnitude + expected.abs()) + 1e-6).all()


@pytest.mark.parametrize("isa_name", ISAS)
def test_float32_queries_on_bf16_cache(isa_name: str) -> None:
    q, k, v, context, meta, num_blocks = make_batch(64, 16, torch.float32, seed=3)
    cache = filled_cache("bfloat16", context, num_blocks, 16)
    got_cache, ref_cache = cache.clone(), cache.clone()
    got = CpuPagedAttentionBackend(kernels.load_isa(isa_name)).forward(q, k, v, got_cache, meta, 0.125)
    expected = ReferenceAttentionBackend().forward(q, k, v, ref_cache, meta, 0.125)
    assert torch.equal(got_cache, ref_cache)  # round to nearest even, as torch converts
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_bad_cache_layouts_are_errors() -> None:
    q = torch.randn(1, 2, 8)
    kv = torch.randn(1, 2, 8)
    meta = build_attention_metadata([(0, 1)], [[0]], 4)
    args = (meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc, 1.0, -1)
    with pytest.raises(RuntimeError, match=r"rows of 12 Char elements, got 8"):  # the scale's 4 bytes are missing
        ops.paged_attention(q, kv, kv, torch.zeros(2, 1, 4, 2, 8, dtype=torch.int8), *args)
    with pytest.raises(RuntimeError, match="kv_cache must be Float, BFloat16, Char"):
        ops.paged_attention(q, kv, kv, torch.zeros(2, 1, 4, 2, 8, dtype=torch.float16), *args)
    with pytest.raises(RuntimeError, match="key must be BFloat16"):
        ops.paged_attention(q.bfloat16(), kv, kv, torch.zeros(2, 1, 4, 2, 8), *args)
