"""The bf16 block GEMM (gemm_gguf_bf16, csrc/gguf_bf16.cpp) and the dispatcher's choice of it.

The kernel rebuilds panels of weight rows as bf16 (gguf's dequantized floats rounded to nearest even) and
multiplies them by x rounded to bf16 with oneDNN's brgemm (float32 sums). So dequant_gguf_bf16 must equal
gguf's dequantization .to(bfloat16) bit for bit, and y must equal bf16(x) bf16(W)^T + bias up to float32
rounding of the sums (each product of two bf16 is exact in float32), and once more to bf16 for bf16 x. Checked
on random blocks of every type (every bit pattern of quants, packed scales and high bits) with panels of 64
weight rows and a partial one, chunks of 64 rows of x and padded tails, K in one slice and in several with a
shorter last one, float32 and bf16 x, with and without a bias. It runs where the CPU has AVX512-BF16 or AMX;
elsewhere (and in the avx2 / baseline builds) the op says so and the dispatcher never picks it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagedserve import kernels
from pagedserve.kernels import isa
from pagedserve.model.layers import gguf_quant
from pagedserve.model.layers.gguf_quant import concat_rows, gguf_linear, kernel_choice
from tests.model.test_gguf_blocks import TYPES, as_weight, raw_blocks, reference

ISAS = kernels.parity_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="the compiled kernels could not be built here")


def bf16_ops(isa_name: str):
    ops = kernels.load_isa(isa_name)
    return ops if ops.gguf_bf16_types() else None


def check(y: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, bias: torch.Tensor | None, name: str) -> None:
    # y = bf16(x) bf16(W)^T + bias up to the float32 sums' rounding (and y's own rounding to bf16)
    xb, wb = x.bfloat16().double(), ref.bfloat16().double()
    exact = xb @ wb.T + (0 if bias is None else bias.double())
    terms = xb.abs() @ wb.abs().T + (0 if bias is None else bias.double().abs())
    bound = (x.shape[1] + 2) * 2 ** -24 * terms
    if y.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2 ** -8
    err = (y.double() - exact).abs()
    worst = err.argmax()
    assert (err <= bound).all(), f"{name}: off by {err.max():.3g}, bound there {bound.flatten()[worst]:.3g}"


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rebuild_equals_gguf_dequantize_in_bf16(isa_name: str, qtype) -> None:
    # the panels' rebuild (avx512 and amx builds, on any CPU that runs them)
    ops = kernels.load_isa(isa_name)
    raw = raw_blocks(qtype, 37, 512, np.random.default_rng(int(qtype)))
    w = torch.from_numpy(raw.copy())
    if isa_name not in ("avx512", "amx"):
        with pytest.raises(RuntimeError, match=f"the {isa_name} build has no bf16 rebuild"):
            ops.dequant_gguf_bf16(w, int(qtype))
        assert not ops.gguf_bf16_types()
        return
    got = ops.dequant_gguf_bf16(w, int(qtype))
    assert got.dtype == torch.bfloat16 and torch.equal(got, reference(raw, qtype).bfloat16())


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.IQ4_XS], ids=lambda t: t.name)
def test_bf16_gemm_matches_bf16_product(isa_name: str, qtype) -> None:
    ops = bf16_ops(isa_name)
    if ops is None:  # no bf16 brgemm in this build or on this CPU: an error, and the dispatcher never picks it
        with pytest.raises(RuntimeError, match="needs AVX512-BF16 or AMX"):
            kernels.load_isa(isa_name).gemm_gguf_bf16(torch.zeros(1, 256), torch.zeros(1, 144, dtype=torch.uint8),
                                                      int(T.Q4_K), None)
        return
    rng = np.random.default_rng(int(qtype))
    gen = torch.Generator().manual_seed(int(qtype))
    # 150 weight rows at 768 inputs: panels of 64, 64 and 22 rows (128 and 22 on AMX), K in one slice; 40 rows at
    # 2,560 inputs: one partial panel rebuilt in two parts of K (2,048 and 512; one on AMX), multiplied in slices
    # of 1,024, 1,024 and 512; 600 rows at 2,304 inputs: on AMX panels of 256, 256 and 88 rows rebuilt in two parts
    # of K (2,048 and 256)
    for rows, cols in ((150, 768), (40, 2560), (600, 2304)):
        raw = raw_blocks(qtype, rows, cols, rng)
        ref, w = reference(raw, qtype), torch.from_numpy(raw.copy())
        x = torch.randn(131, cols + 16, generator=gen)[:, :cols]  # rows further apart than a row
        x[70, :256] *= 40  # an outlier row
        bias = torch.randn(rows, generator=gen)
        for m in (1, 17, 64, 65, 131):  # chunks of 64 rows, tails padded to 16
            b = bias if m % 2 else None
            y = ops.gemm_gguf_bf16(x[:m], w, int(qtype), b)
            assert y.dtype == torch.float32 and y.shape == (m, rows)
            check(y, x[:m], ref, b, f"{rows}x{cols}, {m} rows")
            yb = ops.gemm_gguf_bf16(x[:m].bfloat16(), w, int(qtype), None if b is None else b.bfloat16())
            assert yb.dtype == torch.bfloat16
            check(yb, x[:m], ref, None if b is None else b.bfloat16().float(), f"bf16, {rows}x{cols}, {m} rows")


@pytest.mark.parametrize("isa_name", ISAS)
def test_dispatcher_picks_bf16(isa_name: str, monkeypatch) -> None:
    # A Q4_K_M-like fused weight (Q4_K and Q6_K parts): gemm_gguf_bf16 per part from bf16_min_rows() rows where the
    # CPU has it, with PAGEDSERVE_GGUF_INT8 and PAGEDSERVE_GGUF_BF16 on; int8 below and with either off; never
    # in batch-invariant mode, nor for a type outside BF16_TYPES (Q4_1)
    rng = np.random.default_rng(5)
    raws = [(T.Q4_K, raw_blocks(T.Q4_K, 24, 512, rng)), (T.Q6_K, raw_blocks(T.Q6_K, 8, 512, rng))]
    fused = concat_rows([as_weight(r, t, 512) for t, r in raws])
    q41 = as_weight(raw_blocks(T.Q4_1, 8, 512, rng), T.Q4_1, 512)
    low = gguf_quant.bf16_min_rows()  # BF16_MIN_ROWS_AMX on CPUs with AMX (oneDNN's brgemm runs on its tiles)
    assert low == (gguf_quant.BF16_MIN_ROWS_AMX if "amx_bf16" in isa.cpu_flags() else gguf_quant.BF16_MIN_ROWS)
    x = torch.randn(low + 3, 512, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(32, generator=torch.Generator().manual_seed(1))
    with kernels.use_isa(isa_name) as ops:
        has_bf16 = bf16_ops(isa_name) is not None
        for int8_env, bf16_env in (("1", "1"), ("1", "0"), ("0", "1")):
            monkeypatch.setenv("PAGEDSERVE_GGUF_INT8", int8_env)
            monkeypatch.setenv("PAGEDSERVE_GGUF_BF16", bf16_env)
            on = has_bf16 and int8_env == bf16_env == "1"
            choice = kernel_choice(ops, torch.float32, fused.qtypes)
            assert choice.bf16_min_rows == (low if on else 0)
            assert kernel_choice(ops, torch.float32, q41.qtypes).path(low) != "bf16"
            assert {choice.path(m, invariant=True) for m in (1, low, 4 * low)} != {"bf16"}
            for dtype in (torch.float32, torch.bfloat16):
                for m in (low - 1, low, low + 3):
                    path = kernel_choice(ops, dtype, fused.qtypes).path(m)
                    assert (path == "bf16") == (on and m >= low), (m, path)
                    if path == "bf16":
                        xm = x[:m].to(dtype)
                        parts = [ops.gemm_gguf_bf16(xm, p, t, None) for t, p in zip(fused.qtypes, fused.parts)]
                        want = torch.cat(parts, dim=1).add_(bias.to(dtype))
                        assert torch.equal(gguf_linear(xm, fused, bias.to(dtype)), want)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("qtype", (T.Q4_1, T.Q8_0), ids=lambda t: t.name)
def test_dispatcher_picks_bf16_for_blocks_of_32(isa_name: str, qtype, monkeypatch) -> None:
    # Q4_1 / Q8_0 with bf16 x: gemm_gguf_bf16 from BF16_BLOCK32_MIN_ROWS rows where the CPU has it and the variant
    # has no gemm_gguf_amx; gemm_gguf below. Float32 x, either env off, batch-invariant: never.
    rng = np.random.default_rng(7)
    raw = raw_blocks(qtype, 40, 512, rng)
    w, low = as_weight(raw, qtype, 512), gguf_quant.BF16_BLOCK32_MIN_ROWS
    x = torch.randn(low + 1, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    with kernels.use_isa(isa_name) as ops:
        can = bf16_ops(isa_name) is not None and getattr(ops, "gemm_gguf_amx", None) is None
        for int8_env, bf16_env in (("1", "1"), ("1", "0"), ("0", "1")):
            monkeypatch.setenv("PAGEDSERVE_GGUF_INT8", int8_env)
            monkeypatch.setenv("PAGEDSERVE_GGUF_BF16", bf16_env)
            on = can and int8_env == bf16_env == "1"
            assert kernel_choice(ops, torch.bfloat16, w.qtypes).path(low - 1) != "bf16"
            assert (kernel_choice(ops, torch.bfloat16, w.qtypes).path(low) == "bf16") == on
            assert kernel_choice(ops, torch.bfloat16, w.qtypes).path(low, invariant=True) != "bf16"
            assert kernel_choice(ops, torch.float32, w.qtypes).path(4 * low) != "bf16"
        if can:
            monkeypatch.setenv("PAGEDSERVE_GGUF_INT8", "1")
            monkeypatch.setenv("PAGEDSERVE_GGUF_BF16", "1")
            y = gguf_linear(x, w, None)
            assert torch.equal(y, ops.gemm_gguf_bf16(x, w.parts[0], w.qtypes[0], None))
            check(y, x.float(), reference(raw, qtype), None, f"{qtype.name} through the dispatcher")


def test_bf16_bad_input() -> None:
    ops = next((o for o in map(bf16_ops, ISAS) if o is not None), None)
    if ops is None:
        pytest.skip("no bf16 brgemm on this CPU")
    w = torch.from_numpy(raw_blocks(T.Q4_K, 4, 256, np.random.default_rng(0)))
    with pytest.raises(RuntimeError, match="GGML type 1 has no kernel"):  # F16
        ops.gemm_gguf_bf16(torch.randn(1, 256), torch.zeros(4, 512, dtype=torch.uint8), int(T.F16), None)
    with pytest.raises(RuntimeError, match="gemm_gguf_bf16: x has 128 features, the weight's rows hold 256"):
        ops.gemm_gguf_bf16(torch.randn(1, 128), w, int(T.Q4_K), None)
    with pytest.raises(RuntimeError, match="x must be Float or BFloat16"):
        ops.gemm_gguf_bf16(torch.randn(1, 256).half(), w, int(T.Q4_K), None)
    with pytest.raises(RuntimeError, match="bias has 3 entries"):
        ops.gemm_gguf_bf16(torch.randn(1, 256), w, int(T.Q4_K), torch.zeros(3))
    assert ops.gemm_gguf_bf16(torch.randn(0, 256), w, int(T.Q4_K), None).shape == (0, 4)
