"""The compiled decoder stack (model/layers/decoder_stack.py) computes what the layer modules compute, bit for
bit: logits and every layer's KV cache, for decode rows, prefill chunks and mixed batches, float32 and bfloat16,
on weights the AMX GEMM takes (Q4_1), on weights only gemm_gguf takes (Q4_K), on fused weights of several
types (Q4_K_M-like), and through the int8 kernel (gemm_gguf_int8) where it runs, in batch-invariant mode too
(every step's GEMMs in the stack, int8 in its invariant form: the modules' gguf_linear passes the same flag). Where
some layer needs the
modules (a float weight, a batch that goes through dequantized tiles, the reference attention) the model runs
the modules."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagedserve import kernels
from pagedserve.attention.backend import get_attention_backend
from pagedserve.model.gguf_file import open_gguf_file
from pagedserve.model.gguf_weights import load_gguf_blocks
from pagedserve.model.layers.decoder_stack import DecoderStack
from pagedserve.model.layers import gguf_quant
from pagedserve.model.layers.gguf_quant import kernel_choice
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.worker.kv_cache import allocate_kv_caches
from tests.model.test_gguf_blocks import KV_HEADS, LAYER_TYPES, VOCAB, tiny_config, write_gguf
from tests.paged_metadata import build_attention_metadata, scattered_block_tables

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="the compiled kernels could not be built here")
BLOCK_SIZE, NUM_BLOCKS, HEAD_DIM = 16, 24, 64
# (tokens already cached, new tokens) per sequence: 1, 3, 8 and 44 rows of x.
BATCHES = [[(0, 1)], [(5, 1), (17, 1), (30, 1)], [(3, 1), (0, 6), (40, 1)], [(0, 24), (4, 20)]]


def _model(tmp_path, qtypes: dict, dtype: torch.dtype, backend: str = "cpu") -> LlamaForCausalLM:
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, False, qtypes)
    model = LlamaForCausalLM(tiny_config(False), get_attention_backend(backend, "cpu"), dtype=dtype)
    load_gguf_blocks(model, open_gguf_file(path), tiny_config(False))
    return model


def _forward(model, seqs, caches, tables, between_layers=None):
    meta = build_attention_metadata(seqs, tables, BLOCK_SIZE)
    gen = torch.Generator().manual_seed(len(seqs))
    ids = torch.randint(0, VOCAB, (sum(q for _, q in seqs),), generator=gen)
    positions = torch.cat([torch.arange(c, c + q) for c, q in seqs])
    hidden = model(ids, positions, caches, meta, between_layers=between_layers)
    return model.compute_logits(hidden), meta, ids, positions


# every linear of one type, or LAYER_TYPES: qkv Q4_K + Q5_K + Q6_K, gate_up Q5_0 + Q5_1, every kernel type;
# "Q4_K_M int8": a Q4_K_M file's types (v and down Q6_K) with gemm_gguf_int8 on (the suite turns it off,
# tests/conftest.py), where the kernel variant has it
Q4_K_M = dict({kind: T.Q4_K for kind in LAYER_TYPES}, attn_v=T.Q6_K, ffn_down=T.Q6_K)
LAYER_QTYPES = {"Q4_1": {kind: T.Q4_1 for kind in LAYER_TYPES}, "Q4_K": {kind: T.Q4_K for kind in LAYER_TYPES},
                "mixed": LAYER_TYPES, "Q4_K_M int8": Q4_K_M}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("types", list(LAYER_QTYPES))
def test_stack_equals_modules(tmp_path, types, dtype, monkeypatch) -> None:
    qtypes = LAYER_QTYPES[types]
    if types.endswith("int8"):
        monkeypatch.setenv("PAGEDSERVE_GGUF_INT8", "1")
    model = _model(tmp_path, qtypes, dtype)
    used = _stack_vs_modules(model, dtype)
    # Batches that gguf_linear sends through dequantized tiles run the modules: above 64 rows, or above 8 in
    # the baseline build (never for bf16 Q4_1 on AMX).
    ops = kernels.load()
    tiles = [any(kernel_choice(ops, dtype, (int(t),)).path(sum(q for _, q in seqs)) == "tiles"
                 for t in set(qtypes.values())) for seqs in BATCHES]
    assert used == [not t for t in tiles]
    if kernels.selected_isa() != "baseline":
        assert used == [True, True, True, True]
    int8 = [kernel_choice(ops, dtype, (int(t),)).path(8) == "int8" for t in set(qtypes.values())]
    assert all(int8) == (types.endswith("int8") and int(T.Q4_K) in ops.gguf_int8_types())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_stack_runs_every_step(tmp_path, dtype, monkeypatch) -> None:
    # Batch-invariant Q4_K_M with int8 on: 1, 3, 8 and 44 rows all stay in the stack (gemm_gguf_int8's
    # batch_invariant flag picks its driver; the modules pass the same flag), bit for bit the modules' result.
    monkeypatch.setenv("PAGEDSERVE_GGUF_INT8", "1")
    model = _model(tmp_path, Q4_K_M, dtype)
    model.set_batch_invariant(True)
    assert _stack_vs_modules(model, dtype) == [True] * len(BATCHES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stack_runs_bf16_gemm(tmp_path, dtype, monkeypatch) -> None:
    # gemm_gguf_bf16 (gemm id 3) from BF16_MIN_ROWS rows, here lowered to 8, where the CPU has it: the 8- and
    # 44-row batches of a Q4_K_M model take it in the stack and in the modules alike, bit for bit the same
    monkeypatch.setenv("PAGEDSERVE_GGUF_INT8", "1")
    monkeypatch.setattr(gguf_quant, "BF16_MIN_ROWS", 8)
    monkeypatch.setattr(gguf_quant, "BF16_MIN_ROWS_AMX", 8)
    if not kernels.load().gguf_bf16_types():
        pytest.skip("no bf16 brgemm on this CPU (it needs AVX512-BF16 or AMX)")
    model = _model(tmp_path, Q4_K_M, dtype)
    assert _stack_vs_modules(model, dtype) == [True] * len(BATCHES)
    ops = kernels.load()
    assert [kernel_choice(ops, dtype, (int(T.Q4_K), int(T.Q6_K))).path(sum(q for _, q in seqs)) for seqs in BATCHES] \
        == ["int8", "int8", "bf16", "bf16"]


def _stack_vs_modules(model, dtype: torch.dtype) -> list[bool]:
    # Per batch of BATCHES: the stack's logits and caches equal the modules', also when another thread's flag
    # stops either between layers (never, once, before every layer) for a call (an urgent step's place,
    # engine/urgent_steps.py) and it goes on from there; returns whether the stack ran it.
    gen = torch.Generator().manual_seed(0)
    caches = [c.copy_(torch.randn(c.shape, generator=gen)) for c in
              allocate_kv_caches(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, "cpu")]
    used = []
    for seqs in BATCHES:
        tables = scattered_block_tables([c + q for c, q in seqs], BLOCK_SIZE, NUM_BLOCKS)
        stack_caches = [c.clone() for c in caches]
        model._stack = False  # built again at the next forward
        got, meta, ids, positions = _forward(model, seqs, stack_caches, tables)
        assert isinstance(model._stack, DecoderStack)
        used.append(model._stack(model.model.embed_tokens(ids), positions, [c.clone() for c in caches], meta)
                    is not None)
        model._stack = None  # the modules
        want, *_ = _forward(model, seqs, caches, tables)
        assert torch.equal(got, want), f"{seqs}: logits differ by {(got - want).abs().max()}"
        for layer, (a, b) in enumerate(zip(stack_caches, caches)):
            assert torch.equal(a, b), f"{seqs}: layer {layer}'s cache differs"
        for stack in (False, None):  # the stack's runs, the modules
            for stops in ("never", "once", "every layer"):
                between = Stops(stops != "never", stops == "every layer")
                split_caches = [c.clone() for c in caches]
                model._stack = stack
                split, *_ = _forward(model, seqs, split_caches, tables, between)
                assert between.calls == {"never": 0, "once": 1, "every layer": len(caches) - 1}[stops]
                assert torch.equal(split, want), f"{seqs} {stack} {stops}: differ by {(split - want).abs().max()}"
                assert all(torch.equal(a, b) for a, b in zip(split_caches, caches))
    return used


class Stops:
    # BetweenLayers: the flag set from the start, and again after each call (keep) or cleared by it.
    def __init__(self, set_: bool, keep: bool) -> None:
        self.flag = torch.tensor([int(set_)], dtype=torch.int64)
        self.keep, self.calls = keep, 0

    def __call__(self) -> None:
        self.calls += 1
        self.flag[0] = int(self.keep)


def test_modules_serve_what_the_stack_does_not(tmp_path) -> None:
    assert DecoderStack.build(_model(tmp_path, dict(LAYER_TYPES, attn_v=T.F16), torch.float32)) is None  # float qkv
    assert DecoderStack.build(_model(tmp_path, dict(LAYER_TYPES, attn_q=T.Q4_1, attn_k=T.Q4_1, attn_v=T.Q4_1,
                                                    ffn_gate=T.Q4_1, ffn_up=T.Q4_1),
                                     torch.float32)) is not None
    assert DecoderStack.build(_model(tmp_path, {k: T.Q4_1 for k in LAYER_TYPES}, torch.float32,
                                     backend="reference")) is None
