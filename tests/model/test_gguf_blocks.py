"""GGUF weights kept as the file's raw blocks (--quantization gguf): the kernels rebuild exactly what
gguf-py's dequantizer returns, for every supported type, at every batch size, in every ISA variant this CPU
runs; the block loader builds the model the dequantizing loader builds. Synthetic small tensors: the types
gguf-py can quantize come from gguf.quants.quantize, the K-quants (which it only dequantizes) are random
blocks with sane fp16 scales, so every bit pattern of their packed scales and high bits is exercised."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from pagedserve import kernels
from pagedserve.attention.backend import get_attention_backend
from pagedserve.model import gguf_weights
from pagedserve.model.gguf_file import open_gguf_file
from pagedserve.model.gguf_weights import dense_tensors, load_gguf_blocks
from pagedserve.model.layers import gguf_quant
from pagedserve.model.layers.gguf_quant import GGUFWeight, concat_rows, gguf_embedding, gguf_linear
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.weight_quant import BlockEmbedding
from pagedserve.quality import teacher_forced_logits
from pagedserve.worker.kv_cache import allocate_kv_caches

T = GGMLQuantizationType
TYPES = [T(t) for t in gguf_quant.GGUF_BLOCK_TYPES]
# Where each type keeps its fp16 scales (d; Q4_1 / Q5_1's m; the K-quants' dmin): byte offsets in a block.
SCALE_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2),
                T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,)}
ISAS = kernels.parity_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="the compiled kernels could not be built here")


def raw_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator,
               scale: float | None = None) -> np.ndarray:
    # uint8 [rows, row_bytes] of random bytes (every bit pattern of quants, packed scales and high bits) with
    # finite fp16 scales: random moderate ones, or all `scale`.
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // elems, nbytes), dtype=np.uint8)
    size = 2e-4 if qtype in (T.Q6_K, T.IQ4_XS) else 1e-3  # their 8-bit scales or values: weights of ~1
    for at in SCALE_FIELDS[qtype]:
        values = np.full(raw.shape[:2], scale) if scale is not None else rng.random(raw.shape[:2]) * size + size / 10
        raw[..., at:at + 2] = values.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    # uint8 [rows, row_bytes] as a GGUF file stores a [rows, cols] weight of this type.
    try:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, qtype)
    except NotImplementedError:  # gguf-py dequantizes the K-quants and IQ4_XS but cannot quantize them
        return raw_blocks(qtype, rows, cols, rng)


def reference(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, qtype).astype(np.float32))


def as_weight(raw: np.ndarray, qtype: GGMLQuantizationType, cols: int) -> GGUFWeight:
    return GGUFWeight((int(qtype),), (torch.from_numpy(raw.copy()),), cols)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_block_kernels_match_gguf_dequantize(isa_name: str, qtype, monkeypatch) -> None:
    rng = np.random.default_rng(int(qtype))
    rows, cols = 40, 512
    raw = random_blocks(qtype, rows, cols, rng)
    ref = reference(raw, qtype)
    w = as_weight(raw, qtype, cols)
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(gguf_quant, "TILE_BYTES", 16 * cols * 4)  # the batched path cuts 40 rows into 3 tiles
    with kernels.use_isa(isa_name) as ops:
        assert torch.equal(ops.dequant_gguf(w.parts[0], int(qtype)), ref)  # bit for bit
        ids = torch.tensor([[3, 0], [39, 3]])
        assert torch.equal(gguf_embedding(w, ids), ref[ids])
        for m in (1, 2, 3, 5, 8, 21, 70):  # block GEMM passes of 8/4/2/1 rows; dequantized tiles above 64 (8 in baseline)
            want = torch.nn.functional.linear(x[:m], ref, bias)
            torch.testing.assert_close(gguf_linear(x[:m], w, bias), want, rtol=1e-5, atol=1e-5)


def test_scale_fields_cover_every_type() -> None:
    assert set(SCALE_FIELDS) == set(TYPES)
    # the load-time NaN/inf check reads every block type's scales
    assert set(gguf_weights._SCALE_OFFSETS) == set(gguf_quant.GGUF_BLOCK_TYPES)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decode_kernel_equals_dequantized_matmul(isa_name: str, qtype) -> None:
    # gemm_gguf (the vectorized decode kernel of csrc/gguf_decode.h; the portable loop in baseline) is gguf's
    # dequantized weight times x up to the order of the float32 sums, on random bytes. 3 blocks per row (K =
    # 96 or 768), 23 weight rows (not a multiple of the 4 or 2 rows a tile takes), 1 to 17 rows of x (passes
    # of 8, 4, 3, 2 and 1), x rows further apart than a row; bf16 x gives the same sums rounded once to bf16.
    rng = np.random.default_rng(int(qtype))
    rows, cols = 23, 3 * GGML_QUANT_SIZES[qtype][0]
    raw = raw_blocks(qtype, rows, cols, rng)
    ref, w = reference(raw, qtype).double(), torch.from_numpy(raw.copy())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(17, cols + 32, generator=gen)[:, :cols]
    xb = x.bfloat16()
    bias = torch.randn(rows, generator=gen)
    with kernels.use_isa(isa_name) as ops:
        assert torch.equal(ops.dequant_gguf(w, int(qtype)), reference(raw, qtype))  # bit for bit
        for m in range(1, 18):
            for b in (None, bias):
                extra = 0 if b is None else b.double()
                want = x[:m].double() @ ref.T + extra
                y = ops.gemm_gguf(x[:m], w, int(qtype), b)
                assert y.dtype == torch.float32
                # float32 sums in any order: within K * 2^-24 of the sum of |terms| (one wrong weight in a
                # row of 768 is ~1e-3 of it)
                bound = cols * 2 ** -24 * (x[:m].double().abs() @ ref.abs().T + abs(extra))
                assert ((y.double() - want).abs() <= bound).all(), f"{m} rows: off by {(y.double() - want).abs().max()}"
                yb = ops.gemm_gguf(xb[:m], w, int(qtype), None if b is None else b.bfloat16())
                wantb = xb[:m].double() @ ref.T + (0 if b is None else b.bfloat16().double())
                assert yb.dtype == torch.bfloat16
                torch.testing.assert_close(yb.double(), wantb.bfloat16().double(), rtol=8e-3, atol=1e-5)
        # exact sums: scales of 1 and integer x make every weight and partial sum an integer below 2^24, so
        # every output is exact whatever the order
        ones = raw_blocks(qtype, rows, cols, rng, scale=1.0)
        exact = torch.from_numpy(ones)
        xi = torch.randint(-4, 5, (9, cols), generator=gen).float()
        assert torch.equal(ops.gemm_gguf(xi, exact, int(qtype), None),
                           (xi.double() @ reference(ones, qtype).double().T).float())
        assert torch.equal(ops.gemm_gguf(xi.bfloat16(), exact, int(qtype), None),
                           ops.gemm_gguf(xi, exact, int(qtype), None).bfloat16())


AMX_OPS = kernels.load_isa("amx") if "amx" in kernels.runnable_isas() and ISAS else None


@pytest.mark.skipif(AMX_OPS is None, reason="this CPU has no AMX (amx_tile, amx_bf16), or no kernels")
@pytest.mark.parametrize("cols", [576, 1600])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_amx_kernel_matches_bf16_reference(qtype, cols: int) -> None:
    # gemm_gguf_amx multiplies the blocks rounded to bf16 (as dequant_gguf(w).bfloat16()) with float32 sums:
    # x rows in 1, 2 and 9 tiles of 16 (padded), and 40 weight rows (2 passes of 32, the last half empty).
    # 1,600 columns = 50 blocks: more than one chunk of K (17 + 17 + 16 block columns) from 3 tiles of x on.
    rng = np.random.default_rng(int(qtype))
    rows = 40
    raw = random_blocks(qtype, rows, cols, rng)
    w = torch.from_numpy(raw.copy())
    ref = reference(raw, qtype).bfloat16().float()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(130, cols + 64, generator=gen).bfloat16()[:, :cols]  # rows apart by more than a row
    bias = torch.randn(rows, generator=gen)
    for m in (1, 5, 16, 17, 40, 130):
        want = x[:m].float() @ ref.T + bias
        y32 = AMX_OPS.gemm_gguf_amx(x[:m], w, int(qtype), bias, torch.float32)
        torch.testing.assert_close(y32, want, rtol=1e-5, atol=1e-5)  # measured: max error 2.4e-6 (576), 5.2e-6 (1600)
        y = AMX_OPS.gemm_gguf_amx(x[:m], w, int(qtype), bias)  # bf16 out: the same sums, rounded once
        assert y.dtype == torch.bfloat16 and torch.equal(y, y32.bfloat16())
    assert torch.equal(AMX_OPS.gemm_gguf_amx(x[:3], w, int(qtype), None, torch.float32),
                       AMX_OPS.gemm_gguf_amx(x[:3], w, int(qtype), torch.zeros(rows), torch.float32))
    assert torch.equal(AMX_OPS.dequant_gguf_bf16(w, int(qtype)), ref.bfloat16())
    with pytest.raises(RuntimeError, match="GGML type 2 has no AMX kernel"):
        AMX_OPS.gemm_gguf_amx(x[:1, :32], torch.zeros(4, 18, dtype=torch.uint8), 2, None)
    with pytest.raises(RuntimeError, match="x must be BFloat16"):
        AMX_OPS.gemm_gguf_amx(x[:1].float(), w, int(qtype), None)


@pytest.mark.skipif(AMX_OPS is None, reason="needs the amx kernel variant (a CPU with AMX)")
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols", [(40, 576), (8200, 576)])  # 8,200 x 576: rebuilt in two parts
def test_amx_kernel_many_rows_through_torch_gemm(qtype, rows: int, cols: int) -> None:
    # From 512 rows of x on, a bf16 result comes from the weight rebuilt as bf16 and torch's GEMM: float32 sums
    # in another order, rounded to bf16 once, and the bias added in bf16.
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, rows, cols, rng)
    w = torch.from_numpy(raw.copy())
    ref = reference(raw, qtype).bfloat16().float()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(600, cols, generator=gen).bfloat16()
    bias = torch.randn(rows, generator=gen).bfloat16()
    for m in (512, 600):
        exact = x[:m].float() @ ref.T
        y = AMX_OPS.gemm_gguf_amx(x[:m], w, int(qtype), bias)
        assert y.dtype == torch.bfloat16 and y.shape == (m, rows)
        # |error| <= the bf16 rounding of the sum and of the bias add (2^-8 relative each, with headroom)
        bound = 2 ** -7 * (exact.abs() + bias.float().abs()) + 1e-3 * exact.abs().max()
        assert ((y.float() - (exact + bias.float())).abs() <= bound).all()
        parts = (4 << 20) // cols  # rows per rebuilt part (kDenseChunk weights)
        assert torch.equal(AMX_OPS.gemm_gguf_amx(x[:m], w, int(qtype), None),
                           torch.cat([torch.nn.functional.linear(x[:m], ref[i:i + parts].bfloat16())
                                      for i in range(0, rows, parts)], dim=1))


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_bf16_activations_through_blocks(isa_name: str, qtype) -> None:
    # --dtype bfloat16: bf16 in, bf16 out, at every batch size (the AMX kernel where it runs, else float32
    # block GEMMs on widened x, and bf16 tiles above the decode kernel's rows); the embedding returns bf16 rows.
    rng = np.random.default_rng(int(qtype))
    rows, cols = 40, 512
    raw = random_blocks(qtype, rows, cols, rng)
    ref, w = reference(raw, qtype), as_weight(raw, qtype, cols)
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(0)).bfloat16()
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(1)).bfloat16()
    with kernels.use_isa(isa_name):
        ids = torch.tensor([[3, 0], [39, 3]])
        emb = gguf_embedding(w, ids, torch.bfloat16)
        assert emb.dtype == torch.bfloat16 and torch.equal(emb, ref[ids].bfloat16())
        for m in (1, 5, 21, 70):
            y = gguf_linear(x[:m], w, bias)
            want = x[:m].float() @ ref.T + bias.float()
            assert y.dtype == torch.bfloat16
            # bf16 weights (AMX, tiles) and bf16 outputs: a few bf16 steps of outputs of size ~3
            torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=3e-2)


@pytest.mark.parametrize("isa_name", ISAS)
def test_mixed_type_rows_and_bad_input(isa_name: str) -> None:
    # A fused projection whose parts have different types (as in Q4_K_M files: q/k Q4_K, v Q6_K), one call.
    rng = np.random.default_rng(7)
    parts = [(T.Q4_K, 64), (T.Q4_K, 32), (T.Q6_K, 32), (T.IQ4_XS, 8)]
    raws = [random_blocks(t, n, 256, rng) for t, n in parts]
    fused = concat_rows([as_weight(r, t, 256) for r, (t, _) in zip(raws, parts)])
    assert fused.qtypes == (int(T.Q4_K), int(T.Q6_K), int(T.IQ4_XS))
    assert [p.shape[0] for p in fused.parts] == [96, 32, 8]
    ref = torch.cat([reference(r, t) for r, (t, _) in zip(raws, parts)])
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(136, generator=torch.Generator().manual_seed(1))
    with kernels.use_isa(isa_name):
        for m in (1, 5, 12, 70):  # block GEMM, then dequantized tiles (above 8 rows in baseline, 64 elsewhere)
            torch.testing.assert_close(gguf_linear(x[:m], fused, bias), x[:m] @ ref.T + bias,
                                       rtol=1e-5, atol=1e-5)
    ops = kernels.load()
    with pytest.raises(RuntimeError, match="gemm_gguf: x has 128 features, the weight's rows hold 256"):
        ops.gemm_gguf(torch.randn(1, 128), fused.parts[0], int(T.Q4_K), None)
    with pytest.raises(RuntimeError, match="whole blocks of 144 bytes"):
        ops.gemm_gguf(torch.randn(1, 256), fused.parts[0][:, :100].contiguous(), int(T.Q4_K), None)
    with pytest.raises(RuntimeError, match="GGML type 1 has no kernel"):
        ops.dequant_gguf(fused.parts[0], 1)


# ---------------------------------------------------------------- the block loader on a tiny GGUF

HIDDEN, INTER, VOCAB, HEADS, KV_HEADS = 256, 512, 96, 4, 2
# Every kernel type somewhere, fused projections of mixed types, a type without a kernel (F16) in a fused
# weight, and an F32 norm.
LAYER_TYPES = {"attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K, "attn_output": T.Q4_0,
               "ffn_gate": T.Q5_0, "ffn_up": T.Q5_1, "ffn_down": T.IQ4_XS}


def tiny_config(tied: bool):
    return transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                                    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                                    max_position_embeddings=64, tie_word_embeddings=tied, rms_norm_eps=1e-5)


def write_gguf(path: str, tied: bool, layer_types: dict) -> None:
    rng = np.random.default_rng(3)
    w = GGUFWriter(path, "llama")
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * 64, HIDDEN), "attn_v": (KV_HEADS * 64, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
              "ffn_down": (HIDDEN, INTER)}

    def add(name: str, qtype, rows: int, cols: int) -> None:
        if qtype == T.F16:
            w.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16))
        else:
            w.add_tensor(name, random_blocks(qtype, rows, cols, rng), raw_dtype=qtype)

    add("token_embd.weight", T.Q8_0, VOCAB, HIDDEN)
    for i in range(2):
        for kind, qtype in layer_types.items():
            add(f"blk.{i}.{kind}.weight", qtype, *shapes[kind])
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    if not tied:
        add("output.weight", T.Q4_1, VOCAB, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    caches = allocate_kv_caches(2, 4, 16, KV_HEADS, 64, torch.float32, torch.device("cpu"))
    return teacher_forced_logits(model, ids, caches, 16, chunk)


@pytest.mark.parametrize("tied", [True, False])
def test_block_loader_equals_dequantized_model(tmp_path, tied: bool) -> None:
    path = str(tmp_path / "tiny.gguf")
    layer_types = dict(LAYER_TYPES, attn_v=T.F16) if tied else LAYER_TYPES  # tied: a float part in qkv_proj
    write_gguf(path, tied, layer_types)
    config = tiny_config(tied)
    backend = get_attention_backend("reference", torch.device("cpu"))
    reader = GGUFReader(path)  # the reference: gguf-py's own reader and dequantizer
    dense = LlamaForCausalLM(config, backend, dtype=torch.float32)
    dense.load_weights(dense_tensors(((t.name, t.tensor_type, t.data) for t in reader.tensors), "llama", config, path))
    blocks = LlamaForCausalLM(config, backend, dtype=torch.float32)
    load_gguf_blocks(blocks, open_gguf_file(path), config)

    assert isinstance(blocks.model.embed_tokens, BlockEmbedding)
    qkv = blocks.model.layers[0].self_attn.qkv_proj
    if tied:  # one float part: the whole fused weight is float32
        assert qkv.exact_blocks is None and qkv.weight is not None
        assert blocks._lm_head_blocks[1] is blocks.model.embed_tokens.blocks[1]
    else:
        assert qkv.weight is None and qkv.exact_blocks[1].type_names() == "Q4_K+Q5_K+Q6_K"
        assert blocks.lm_head.weight is None and blocks._lm_head_blocks[1].type_names() == "Q4_1"
    assert blocks.model.layers[1].mlp.gate_up_proj.exact_blocks[1].type_names() == "Q5_0+Q5_1"
    ids = [int(i) for i in np.random.default_rng(0).integers(0, VOCAB, 24)]
    for chunk in (4, 24):  # block GEMM (decode-sized), dequantized tiles (prefill-sized)
        torch.testing.assert_close(_logits(blocks, ids, chunk), _logits(dense, ids, chunk), rtol=1e-4, atol=1e-4)


def test_block_loader_rejects_unknown_tensors(tmp_path) -> None:
    path = str(tmp_path / "odd.gguf")
    w = GGUFWriter(path, "llama")
    w.add_tensor("blk.0.attn_qq.weight", random_blocks(T.Q4_0, 8, 32, np.random.default_rng(0)), raw_dtype=T.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model = LlamaForCausalLM(tiny_config(True), get_attention_backend("reference", torch.device("cpu")),
                             dtype=torch.float32)
    with pytest.raises(ValueError, match="unexpected tensor 'blk.0.attn_qq.weight'"):
        load_gguf_blocks(model, open_gguf_file(path), tiny_config(True))
    assert gguf_weights.hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
