"""The compiled ops reject malformed inputs with a RuntimeError that names the problem, before they read or
write through a bad offset (kernels/csrc/checks.h), and still accept every well-formed call."""
from __future__ import annotations

import pytest
import torch

from tests.paged_metadata import build_attention_metadata, scattered_block_tables
from pagedserve import kernels
from pagedserve.attention.reference import ReferenceAttentionBackend

ops = kernels.load()
pytestmark = pytest.mark.skipif(ops is None, reason="CPU kernels could not be built here")

BLOCK_SIZE, NUM_BLOCKS, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 4, 20, 32, 4, 2
SEQS = [(5, 3), (0, 1), (9, 2)]  # (context, query): 8, 1 and 11 tokens -> 2, 1 and 3 blocks
NUM_TOKENS = sum(q for _, q in SEQS)


def attention_args():
    # Valid paged_attention arguments (in the op's order) and the metadata they came from.
    gen = torch.Generator().manual_seed(0)
    tables = scattered_block_tables([c + q for c, q in SEQS], BLOCK_SIZE, NUM_BLOCKS)
    meta = build_attention_metadata(SEQS, tables, BLOCK_SIZE)  # block_tables padded with 0
    args = dict(query=torch.randn(NUM_TOKENS, NUM_HEADS, HEAD_DIM, generator=gen),
                key=torch.randn(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM, generator=gen),
                value=torch.randn(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM, generator=gen),
                kv_cache=torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen),
                slot_mapping=meta.slot_mapping, block_tables=meta.block_tables, seq_lens=meta.seq_lens,
                query_start_loc=meta.query_start_loc, scale=HEAD_DIM ** -0.5, max_q_len=-1)
    return args, meta


def put(name: str, index, value):
    # Sets one element of a copy of argument `name`.
    def apply(args: dict) -> None:
        args[name] = args[name].clone()
        args[name][index] = value
    return apply


def swap(name: str, fn):
    # Replaces argument `name` by fn(old value).
    def apply(args: dict) -> None:
        args[name] = fn(args[name])
    return apply


def noncontig_last_dim(t: torch.Tensor) -> torch.Tensor:
    # Same shape and values, last dimension strided.
    return torch.stack((t, t), dim=-1)[..., 0]


ATTENTION_CASES = [
    ("qsl_size", swap("query_start_loc", lambda t: t[:-1]), r"query_start_loc must have num_seqs \+ 1 = 4 entries"),
    ("qsl_start", put("query_start_loc", 0, 1), r"query_start_loc\[0\] must be 0, got 1"),
    ("qsl_order", put("query_start_loc", 1, 5), r"query_start_loc must be non-decreasing, got 5 then 4"),
    ("qsl_end_short", put("query_start_loc", 3, 5), r"query_start_loc\[-1\] = 5 must equal the number of query"),
    ("qsl_end_long", put("query_start_loc", 3, 7), r"query_start_loc\[-1\] = 7 must equal the number of query"),
    ("block_id_high", put("block_tables", (2, 2), NUM_BLOCKS), r"block_tables\[2\]\[2\] = 20 outside .* 20 blocks"),
    ("block_id_negative", put("block_tables", (0, 1), -1), r"block_tables\[0\]\[1\] = -1 outside"),
    ("table_too_narrow", swap("block_tables", lambda t: t[:, :2].contiguous()),
     r"block_tables is 2 blocks wide but seq_lens\[2\] = 11 needs 3 blocks"),
    ("table_rows", swap("block_tables", lambda t: t[:2].contiguous()),
     r"block_tables must have a row per sequence \(3\), got 2"),
    ("seq_len_lt_query", put("seq_lens", 0, 2), r"seq_lens\[0\] = 2 is shorter than its query length 3"),
    ("seq_len_negative", put("seq_lens", 1, -1), r"seq_lens\[1\] = -1 is shorter"),
    ("seq_len_past_table", put("seq_lens", 1, 13), r"3 blocks wide but seq_lens\[1\] = 13 needs 4 blocks"),
    ("head_dim", swap("query", lambda t: t[..., :16].contiguous()), r"head size mismatch: query head_dim 16"),
    ("num_heads", swap("query", lambda t: t[:, :3].contiguous()), r"query heads \(3\) must be a positive multiple"),
    ("key_heads", swap("key", lambda t: t[:, :1].contiguous()), r"key must be \[num_tokens, num_kv_heads, head_dim\]"),
    ("key_head_dim", swap("key", lambda t: t[..., :16].contiguous()), r"key must be \[.*\] = \[6, 2, 32\]"),
    ("value_tokens", swap("value", lambda t: t[:-1]), r"value must be \[num_tokens"),
    ("slot_high", put("slot_mapping", 2, NUM_BLOCKS * BLOCK_SIZE), r"slot_mapping\[2\] = 80 outside .* 80 slots"),
    ("slot_count", swap("slot_mapping", lambda t: t[:-1]), r"slot_mapping must have one slot per query token"),
    ("seq_lens_dtype", swap("seq_lens", lambda t: t.int()), r"seq_lens must be Long, got Int"),
    ("qsl_dtype", swap("query_start_loc", lambda t: t.int()), r"query_start_loc must be Long, got Int"),
    ("tables_dtype", swap("block_tables", lambda t: t.int()), r"block_tables must be Long, got Int"),
    ("query_dtype", swap("query", lambda t: t.double()), r"query must be Float or BFloat16, got Double"),
    ("cache_dtype", swap("kv_cache", lambda t: t.half()), r"kv_cache must be Float, BFloat16, Char \(int8\) or Float8_e4m3fn, got Half"),
    ("cache_dims", swap("kv_cache", lambda t: t[0]), r"kv_cache must have 5 dimensions"),
    ("cache_kv_pair", swap("kv_cache", lambda t: t[:1]), r"kv_cache must be \[2, num_blocks"),
    ("cache_noncontig", swap("kv_cache", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
     r"kv_cache must be contiguous"),
    ("query_noncontig", swap("query", noncontig_last_dim), r"query must be contiguous in its last dimension"),
    ("tables_noncontig", swap("block_tables", lambda t: t.t().contiguous().t()), r"block_tables must be contiguous"),
    ("qsl_2d", swap("query_start_loc", lambda t: t[None]), r"query_start_loc must have 1 dimensions"),
]


@pytest.mark.parametrize("mutate,match", [pytest.param(m, r, id=i) for i, m, r in ATTENTION_CASES])
def test_paged_attention_rejects(mutate, match: str) -> None:
    args, _ = attention_args()
    mutate(args)
    cache_before = args["kv_cache"].clone()
    with pytest.raises(RuntimeError, match=match):
        ops.paged_attention(*args.values())
    assert torch.equal(args["kv_cache"], cache_before)  # checked before the first write


@pytest.mark.parametrize("max_q_len", [-1, 2])
def test_paged_attention_well_formed(max_q_len: int) -> None:
    # Entries past a sequence's used blocks and rows past its sequences are padding: never read, so never
    # checked.
    args, meta = attention_args()
    put("block_tables", (1, 2), 10 ** 9)(args)
    args["block_tables"] = torch.cat((args["block_tables"], torch.full((2, 3), -1)))  # rows past num_seqs too
    args["max_q_len"] = max_q_len
    ref_cache = args["kv_cache"].clone()
    expected = ReferenceAttentionBackend().forward(args["query"], args["key"], args["value"], ref_cache, meta,
                                                   args["scale"])
    got = ops.paged_attention(*args.values())
    assert torch.equal(args["kv_cache"], ref_cache)
    ran = [t for (c, q), start in zip(SEQS, meta.query_start_loc.tolist()) if max_q_len < 0 or q <= max_q_len
           for t in range(start, start + q)]
    torch.testing.assert_close(got[ran], expected[ran], atol=1e-5, rtol=1e-5)


def layer_args(op: str) -> list:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen)
    weight = torch.rand(64, generator=gen) + 0.5
    if op == "rms_norm":
        return [x, weight, 1e-5]
    if op == "fused_add_rms_norm_":
        return [x, torch.randn(5, 64, generator=gen), weight, 1e-5]
    if op == "rotary_embedding_":
        q, k = torch.randn(5, NUM_HEADS, 16, generator=gen), torch.randn(5, NUM_KV_HEADS, 16, generator=gen)
        return [q, k, torch.tensor([0, 1, 2, 150, 299]), torch.randn(300, 16, generator=gen)]
    if op == "silu_and_mul":
        return [x]
    from pagedserve.model.weight_quant import quantize_q8_0  # gemm_gguf over Q8_0 blocks

    blocks = quantize_q8_0(torch.randn(48, 96, generator=gen)).parts[0]
    return [torch.randn(3, 96, generator=gen), blocks, 8, torch.randn(48, generator=gen)]


def at(index: int, fn):
    # Replaces positional argument `index` by fn(old value).
    def apply(args: list) -> None:
        args[index] = fn(args[index])
    return apply


LAYER_CASES = [
    ("rms_norm", at(1, lambda w: w[:-1]), r"rms_norm: weight has 63 entries, the hidden size is 64"),
    ("rms_norm", at(1, lambda w: w.double()), r"rms_norm: weight must be Float, got Double"),
    ("rms_norm", at(0, lambda x: x[None]), r"rms_norm: x must have 2 dimensions"),
    ("rms_norm", at(0, noncontig_last_dim), r"rms_norm: x must be contiguous in its last dimension"),
    ("fused_add_rms_norm_", at(1, lambda r: r[:-1]), r"x \[5, 64\] and residual \[4, 64\] must have the same shape"),
    ("fused_add_rms_norm_", at(2, lambda w: w[:32]), r"fused_add_rms_norm_: weight has 32 entries"),
    ("fused_add_rms_norm_", at(1, lambda r: r.int()), r"residual must be Float, got Int"),
    ("rotary_embedding_", at(1, lambda k: k[:-1]), r"key must be \[num_tokens, num_kv_heads, head_dim\]"),
    ("rotary_embedding_", at(1, lambda k: k[..., :8]), r"with query's tokens and head_dim, got query \[5, 4, 16\]"),
    ("rotary_embedding_", at(1, lambda k: k.double()), r"rotary_embedding_: key must be Float, got Double"),
    ("rotary_embedding_", at(1, lambda k: k[0]), r"rotary_embedding_: key must have 3 dimensions"),
    ("rotary_embedding_", at(2, lambda p: p[:-1]), r"positions must have one entry per token \(5\), got 4"),
    ("rotary_embedding_", at(2, lambda p: p.int()), r"positions must be Long, got Int"),
    ("rotary_embedding_", at(2, lambda p: p + 1), r"positions\[4\] = 300 outside the rotary table's 300 positions"),
    ("rotary_embedding_", at(2, lambda p: p - 1), r"positions\[0\] = -1 outside"),
    ("rotary_embedding_", at(3, lambda t: t[:, :8].contiguous()), r"cos_sin must be \[max_position, head_dim = 16\]"),
    ("rotary_embedding_", at(3, lambda t: t[0]), r"cos_sin must have 2 dimensions"),
    ("rotary_embedding_", at(0, lambda q: q[..., :15]), r"head_dim must be even"),
    ("silu_and_mul", at(0, lambda x: x[:, :63]), r"silu_and_mul: gate_up's last dimension must be even"),
    ("silu_and_mul", at(0, lambda x: x[0]), r"silu_and_mul: gate_up must have 2 dimensions"),
    ("gemm_gguf", at(1, lambda w: w.view(torch.int8)), r"gemm_gguf: w must be Byte, got Char"),
    ("gemm_gguf", at(1, lambda w: w[:, :100].contiguous()), r"a row of w must be whole blocks of 34 bytes"),
    ("gemm_gguf", at(1, lambda w: w[:, :68].contiguous()), r"x has 96 features, the weight's rows hold 64"),
    ("gemm_gguf", at(2, lambda t: 99), r"GGML type 99 has no kernel"),
    ("gemm_gguf", at(3, lambda b: b[:-1]), r"bias has 47 entries, the weight has 48 rows"),
    ("gemm_gguf", at(3, lambda b: b.double()), r"gemm_gguf: bias must be Float or x's dtype"),
    ("gemm_gguf", at(0, lambda x: x.double()), r"gemm_gguf: x must be Float or BFloat16, got Double"),
]


@pytest.mark.parametrize("op,mutate,match", [pytest.param(o, m, r, id=f"{o}-{n}")
                                              for n, (o, m, r) in enumerate(LAYER_CASES)])
def test_layer_op_rejects(op: str, mutate, match: str) -> None:
    args = layer_args(op)
    mutate(args)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(RuntimeError, match=match):
        getattr(ops, op)(*args)
    for a, b in zip(args, before):  # in-place ops changed nothing
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b)


@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm_", "rotary_embedding_", "silu_and_mul", "gemm_gguf"])
def test_layer_op_well_formed(op: str) -> None:
    # The exact results are checked in test_cpu_kernels.py; here: the checks let the model's calls through,
    # including the non-contiguous q/k views the model passes to the rotary op.
    args = layer_args(op)
    if op == "rotary_embedding_":
        fused = torch.cat((args[0].flatten(1), args[1].flatten(1)), dim=1)
        args[0], args[1] = fused[:, :64].view(5, 4, 16), fused[:, 64:].view(5, 2, 16)
    out = getattr(ops, op)(*args)
    assert out is None or bool(torch.isfinite(out).all())
