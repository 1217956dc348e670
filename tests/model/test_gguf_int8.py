"""The int8-activation block GEMM (gemm_gguf_int8, csrc/gguf_int8.h) and the dispatcher's choice of it.

The kernel quantizes each row of x to int8 per 256 values (dx = max|x| / 127, q = round(x / dx)) and multiplies
the weights' integer quants into it; so its result is gguf's dequantized weight times x^ = dx * q, exactly up to
float32 rounding, and differs from the float kernels' by at most sum_k |w_k| * dx / 2 (x's rounding). Both are
checked on random blocks of every type the kernel has (every bit pattern of quants, packed scales and high
bits), for rows of x 1..301 (odd counts, more than one pass of 64; the k-quants' register tiles from 32 rows,
csrc/gguf_int8_tiles.h, with partial tiles of x and of weight rows, and K in several slices), float32 and bf16
x, both dot products this CPU runs (VNNI and vpmaddubsw + vpmaddwd) and every kernel variant the parity tests
run (avx512 / amx and avx2 have the kernel; baseline, which has none, must never pick it)."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from pagedserve import kernels
from pagedserve.model.layers import gguf_quant
from pagedserve.model.layers.gguf_quant import concat_rows, gguf_linear, kernel_choice
from tests.model.test_gguf_blocks import as_weight, raw_blocks, reference

ISAS = kernels.parity_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="the compiled kernels could not be built here")
# every type the kernel has (the dispatcher picks it for gguf_quant.INT8_TYPES); Q8_0 and IQ4_XS need VNNI
KERNEL_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS]
VNNI_ONLY = (T.Q8_0, T.IQ4_XS)
ROWS = (1, 2, 3, 4, 5, 8, 17, 31, 32, 64, 70, 301)


def int8_ops(isa_name: str):
    ops = kernels.load_isa(isa_name)
    return ops if ops.gguf_int8_types() else None


def dots(ops) -> list[bool | None]:
    # the dot products: None (the variant's best on this CPU), False (vpmaddubsw + vpmaddwd), True (VNNI,
    # where the variant has it and the CPU runs it)
    return [None, False] + ([True] if ops.gguf_int8_types(True) else [])


def quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # (x^ as float64, the per-value bound on how far the kernel's x^ may be from it): x^ = dx * round(x / dx)
    # per 256 values, rounded as the kernel does (float32 x * (127 / max), ties to even). A value within 1e-4
    # of a tie may round either way (the kernel's 127 / max may differ by an ulp under -ffast-math): dx.
    m, k = x.shape
    g = padded(x).reshape(m, -1, 256)
    top = g.abs().amax(-1, keepdim=True)
    scaled = g * torch.where(top > 0, 127 / top, torch.zeros_like(top))
    q = torch.round(scaled).clamp(-127, 127)
    d = (top / 127).double()
    ambiguous = ((scaled - scaled.floor() - 0.5).abs() < 1e-4).double() * d
    return (q.double() * d).reshape(m, -1)[:, :k], ambiguous.reshape(m, -1)[:, :k]


def padded(x: torch.Tensor) -> torch.Tensor:
    # float32 x with its columns zero-padded to whole groups of 256 (the kernel's last group may be partial)
    return torch.nn.functional.pad(x.float(), (0, -x.shape[1] % 256))


def check(y: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, bias: torch.Tensor | None, numerics: dict,
          name: str) -> None:
    # y = x^ W^T + bias up to float32 rounding; and within x's int8 rounding of x W^T + bias
    extra = 0 if bias is None else bias.double()
    xh, ambiguous = quantized(x)
    w_abs = ref.abs()
    terms = xh.abs() @ w_abs.T + (0 if bias is None else bias.double().abs())
    exact = xh @ ref.T + extra
    rounding = ambiguous @ w_abs.T
    if y.dtype == torch.bfloat16:  # the same sums rounded once to bf16
        rounding = rounding + exact.abs() * 2 ** -8
    float_sums = x.shape[1] * 2 ** -24 * terms
    err = (y.double() - exact).abs()
    assert (err <= float_sums + rounding).all(), f"{name}: off x^ W^T by {err.max():.3g}"
    # against float x: |x^ - x| <= dx / 2 per value
    dx = (padded(x).reshape(x.shape[0], -1, 256).abs().amax(-1, keepdim=True) / 127).double()
    int8_rounding = (dx.expand(-1, -1, 256).reshape(x.shape[0], -1)[:, :x.shape[1]] / 2) @ w_abs.T * (1 + 1e-3)
    full = (y.double() - (x.double() @ ref.T + extra)).abs()
    bound = int8_rounding + float_sums + rounding
    assert (full <= bound).all(), f"{name}: off x W^T by {full.max():.3g}, bound {bound.min():.3g}"
    key = f"int8 error / x rounding bound ({'bf16' if y.dtype == torch.bfloat16 else 'f32'})"
    numerics[key] = max(numerics.get(key, 0.0), float((full / int8_rounding).max()))


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_int8_kernel_matches_quantized_x(isa_name: str, qtype, numerics) -> None:
    ops = int8_ops(isa_name)
    if ops is None:  # no int8 kernel in this variant: an error, and the dispatcher never picks it
        with pytest.raises(RuntimeError, match=f"has no int8 kernel in the {isa_name} build"):
            kernels.load_isa(isa_name).gemm_gguf_int8(torch.zeros(1, 256), torch.zeros(1, 144, dtype=torch.uint8),
                                                      int(T.Q4_K), None)
        return
    rng = np.random.default_rng(int(qtype))
    # 23 weight rows: pairs and a last single row; 768 inputs (3 groups of 256), or 576 for blocks of 32 (the
    # last group a quarter full)
    rows, cols = 23, 768 if GGML_QUANT_SIZES[qtype][0] == 256 else 576
    raw = raw_blocks(qtype, rows, cols, rng)
    ref, w = reference(raw, qtype).double(), torch.from_numpy(raw.copy())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max(ROWS), cols + 32, generator=gen)[:, :cols]  # rows further apart than a row
    x[5, 256:512] *= 50  # an outlier group: its own scale
    x[6, :256] = 0  # an all-zero group
    xb = x.bfloat16()
    bias = torch.randn(rows, generator=gen)
    ways = [dot for dot in dots(ops) if dot is not False or qtype not in VNNI_ONLY]  # None: as one of the others
    if qtype in VNNI_ONLY:
        with pytest.raises(RuntimeError, match=f"needs AVX512-VNNI|type {int(qtype)} has no int8 kernel"):
            ops.gemm_gguf_int8(x[:5], w, int(qtype), None, False)  # beyond the few-row kernel (avx2 has it)
        assert int(qtype) not in ops.gguf_int8_types(False)
        if True not in ways:
            assert int(qtype) not in ops.gguf_int8_types()
            return
    for m in ROWS:
        for dot in ways[1:]:
            b = bias if m % 2 else None
            y = ops.gemm_gguf_int8(x[:m], w, int(qtype), b, dot)
            assert y.dtype == torch.float32 and y.shape == (m, rows)
            check(y, x[:m], ref, b, numerics, f"{m} rows, vnni={dot}")
            yb = ops.gemm_gguf_int8(xb[:m], w, int(qtype), None if b is None else b.bfloat16(), dot)
            assert yb.dtype == torch.bfloat16
            check(yb, xb[:m].float(), ref, None if b is None else b.bfloat16().float(), numerics,
                  f"bf16, {m} rows, vnni={dot}")
        # every dot product gives the same integers, so the same floats
        results = [ops.gemm_gguf_int8(x[:m], w, int(qtype), None, dot) for dot in ways]
        assert all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS], ids=lambda t: t.name)
def test_int8_tiles_long_rows(isa_name: str, qtype, numerics) -> None:
    # The register tiles (csrc/gguf_int8_tiles.h) where the other test's shapes do not reach: 2,560 inputs (K in
    # two slices of 5 groups), 210 rows of x (two chunks of 105 rows: 512 KB of x at most), 9 weight rows
    # (panels of 4 rows, the last one partial). IQ4_XS where the CPU has VNNI.
    ops = int8_ops(isa_name)
    if ops is None or int(qtype) not in ops.gguf_int8_types():
        pytest.skip(f"no int8 kernel for {qtype.name} in the {isa_name} build")
    rng = np.random.default_rng(100 + int(qtype))
    raw = raw_blocks(qtype, 9, 2560, rng)
    ref, w = reference(raw, qtype).double(), torch.from_numpy(raw.copy())
    x = torch.randn(210, 2560, generator=torch.Generator().manual_seed(1))
    x[100, 2048:] *= 30  # an outlier group in the second slice
    bias = torch.randn(9, generator=torch.Generator().manual_seed(2))
    for m in (40, 210):
        results = []
        for dot in [d for d in dots(ops)[1:] if d or qtype not in VNNI_ONLY or ops.compiled_isa() == "avx2"]:
            y = ops.gemm_gguf_int8(x[:m], w, int(qtype), bias, dot)
            check(y, x[:m], ref, bias, numerics, f"{m} rows, vnni={dot}")
            yb = ops.gemm_gguf_int8(x[:m].bfloat16(), w, int(qtype), None, dot)
            check(yb, x[:m].bfloat16().float(), ref, None, numerics, f"bf16, {m} rows, vnni={dot}")
            results.append(y)
        assert all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize("isa_name", ISAS)
def test_dispatcher_picks_int8(isa_name: str, monkeypatch) -> None:
    # A Q4_K_M-like fused weight (Q4_K and Q6_K parts): gemm_gguf_int8 per part from INT8_MIN_ROWS rows on
    # (prefill too: float32 x has no upper bound; gemm_gguf_bf16, which takes prompts where the CPU has it, is
    # off here: tests/model/test_gguf_bf16.py) where the variant has it and PAGEDSERVE_GGUF_INT8 is not "0";
    # otherwise the float kernels, exactly as before.
    # A weight with a type the int8 kernel lacks (Q4_1 beyond avx2's few rows) keeps the float kernels.
    rng = np.random.default_rng(5)
    raws = [(T.Q4_K, raw_blocks(T.Q4_K, 24, 512, rng)), (T.Q6_K, raw_blocks(T.Q6_K, 8, 512, rng))]
    fused = concat_rows([as_weight(r, t, 512) for t, r in raws])
    ref = torch.cat([reference(r, t) for t, r in raws]).double()
    q41 = as_weight(raw_blocks(T.Q4_1, 8, 512, rng), T.Q4_1, 512)
    x = torch.randn(200, 512, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(32, generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv("PAGEDSERVE_GGUF_BF16", "0")
    with kernels.use_isa(isa_name) as ops:
        has_int8 = int8_ops(isa_name) is not None
        for env in ("1", "0"):
            monkeypatch.setenv("PAGEDSERVE_GGUF_INT8", env)
            int8 = env == "1" and has_int8
            choice = kernel_choice(ops, torch.float32, fused.qtypes)
            assert choice.int8_max_rows == (sys.maxsize if int8 else 0)
            # from 1 row where the variant has the few-row kernel (avx2, avx512, amx), else from INT8_MIN_ROWS
            few_rows = has_int8 and isa_name in ("avx2", "avx512", "amx")
            # Q8_0 and IQ4_XS where the CPU has VNNI; Q4_1 and Q8_0 on avx2
            more = {8, 23} if ops.gguf_int8_types(True) else {3, 8} if isa_name == "avx2" else set()
            assert set(ops.gguf_int8_gemv_types()) == ({12, 13, 14} | more if few_rows else set())
            low = gguf_quant.INT8_GEMV_MIN_ROWS if few_rows else gguf_quant.INT8_MIN_ROWS
            assert not int8 or choice.int8_min_rows == low
            # Q4_1: 1-2 rows on avx2 only (test_dispatcher_picks_int8_for_iq4_xs_q8_0_and_q4_1)
            assert kernel_choice(ops, torch.float32, q41.qtypes).path(3) != "int8"
            for m in (1, 2, 4, gguf_quant.INT8_MIN_ROWS, 7, 64, 65, 200):
                y = gguf_linear(x[:m], fused, bias)
                if int8 and m >= low:
                    assert choice.path(m) == "int8"
                    parts = [ops.gemm_gguf_int8(x[:m], p, t, None) for t, p in zip(fused.qtypes, fused.parts)]
                    assert torch.equal(y, torch.cat(parts, dim=1).add_(bias))
                else:
                    assert choice.path(m) != "int8"
                    torch.testing.assert_close(y.double(), x[:m].double() @ ref.T + bias.double(),
                                               rtol=1e-5, atol=1e-5)


def test_int8_bad_input() -> None:
    ops = next((o for o in map(int8_ops, ISAS) if o is not None), None)
    if ops is None:
        pytest.skip("no kernel variant here has the int8 kernel")
    w = torch.from_numpy(raw_blocks(T.Q4_K, 4, 256, np.random.default_rng(0)))
    with pytest.raises(RuntimeError, match="GGML type 1 has no kernel"):  # F16
        ops.gemm_gguf_int8(torch.randn(1, 256), torch.zeros(4, 512, dtype=torch.uint8), int(T.F16), None)
    with pytest.raises(RuntimeError, match="type 23 needs AVX512-VNNI|GGML type 23 has no int8 kernel"):  # IQ4_XS
        ops.gemm_gguf_int8(torch.randn(1, 256), torch.zeros(4, 136, dtype=torch.uint8), int(T.IQ4_XS), None, False)
    with pytest.raises(RuntimeError, match="gemm_gguf_int8: x has 128 features, the weight's rows hold 256"):
        ops.gemm_gguf_int8(torch.randn(1, 128), w, int(T.Q4_K), None)
    with pytest.raises(RuntimeError, match="x must be Float or BFloat16"):
        ops.gemm_gguf_int8(torch.randn(1, 256).half(), w, int(T.Q4_K), None)
    with pytest.raises(RuntimeError, match="bias has 3 entries"):
        ops.gemm_gguf_int8(torch.randn(1, 256), w, int(T.Q4_K), torch.zeros(3))
    if True not in dots(ops):
        with pytest.raises(RuntimeError, match="no AVX512-VNNI"):
            ops.gemm_gguf_int8(torch.randn(1, 256), w, int(T.Q4_K), None, True)
    assert ops.gemm_gguf_int8(torch.randn(0, 256), w, int(T.Q4_K), None).shape == (0, 4)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.IQ4_XS, T.Q4_1], ids=lambda t: t.name)
def test_int8_few_rows_long_weight_rows(qtype, numerics) -> None:
    # 1-4 rows of x take the few-row kernels (csrc/gguf_int8_gemv.h; Q8_0, IQ4_XS with VNNI on avx512 / amx; Q4_1
    # and Q8_0 on avx2) where the variant has them; rows of more than 4,096 inputs (here 4,352; Q8_0 4,384: a last group of one block) take
    # 3-4 rows of x in passes of 2; 37 weight rows (split between threads)
    ops = next((o for o in map(int8_ops, ISAS) if o is not None and int(qtype) in o.gguf_int8_gemv_types()), None)
    if ops is None:
        pytest.skip("no kernel variant here has the few-row int8 kernel")
    rng = np.random.default_rng(int(qtype) + 100)
    cols = 4384 if qtype == T.Q8_0 else 4352
    raw = raw_blocks(qtype, 37, cols, rng)
    ref, w = reference(raw, qtype).double(), torch.from_numpy(raw.copy())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, cols, generator=gen)
    x[2, 512:768] *= 30
    bias = torch.randn(37, generator=gen)
    for m in (1, 2, 3, 4):
        for dot in [d for d in dots(ops)[1:] if d or qtype not in VNNI_ONLY or ops.compiled_isa() == "avx2"]:
            check(ops.gemm_gguf_int8(x[:m], w, int(qtype), bias, dot), x[:m], ref, bias, numerics, f"{m} rows")
        yb = ops.gemm_gguf_int8(x[:m].bfloat16(), w, int(qtype), None)
        check(yb, x[:m].bfloat16().float(), ref, None, numerics, f"bf16, {m} rows")


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_dispatcher_picks_int8_for_q5(isa_name: str, qtype, monkeypatch) -> None:
    # Q5_0 / Q5_1 (and a fused weight of both): gemm_gguf_int8 for INT8_Q5_ROWS rows on avx512 / amx with
    # PAGEDSERVE_GGUF_INT8 on, the float kernels below and above and everywhere else
    rng = np.random.default_rng(int(qtype))
    w = concat_rows([as_weight(raw_blocks(qtype, 8, 576, rng), qtype, 576),
                     as_weight(raw_blocks(T.Q5_1, 8, 576, rng), T.Q5_1, 576)])
    x = torch.randn(65, 576, generator=torch.Generator().manual_seed(0))
    low, high = gguf_quant.INT8_Q5_ROWS
    monkeypatch.setenv("PAGEDSERVE_GGUF_INT8", "1")
    with kernels.use_isa(isa_name) as ops:
        on = isa_name in ("avx512", "amx") and int8_ops(isa_name) is not None
        choice = kernel_choice(ops, torch.float32, w.qtypes)
        for m in (1, low - 1, low, high, high + 1):
            want = "int8" if on and low <= m <= high else None
            assert (choice.path(m) == "int8") == (want == "int8"), (m, choice)
            if want:
                parts = [ops.gemm_gguf_int8(x[:m], p, t, None) for t, p in zip(w.qtypes, w.parts)]
                assert torch.equal(gguf_linear(x[:m], w, None), torch.cat(parts, dim=1))


@pytest.mark.parametrize("isa_name", ISAS)
def test_dispatcher_picks_int8_for_iq4_xs_q8_0_and_q4_1(isa_name: str, monkeypatch) -> None:
    # On avx512 / amx where the CPU has VNNI: IQ4_XS alone and fused with a Q6_K part take gemm_gguf_int8 from 1
    # row on (no upper bound: 300 rows run the tiles), Q8_0 for INT8_BLOCK32_ROWS; on avx2 Q8_0 and Q4_1 for
    # INT8_BLOCK32_ROWS (the few-row kernel only); else the float kernels
    rng = np.random.default_rng(23)
    raws = [(T.IQ4_XS, raw_blocks(T.IQ4_XS, 8, 512, rng)), (T.Q6_K, raw_blocks(T.Q6_K, 8, 512, rng)),
            (T.Q8_0, raw_blocks(T.Q8_0, 8, 512, rng)), (T.Q4_1, raw_blocks(T.Q4_1, 8, 512, rng))]
    weights = [as_weight(raws[0][1], T.IQ4_XS, 512), concat_rows([as_weight(r, t, 512) for t, r in raws[:2]]),
               as_weight(raws[2][1], T.Q8_0, 512), as_weight(raws[3][1], T.Q4_1, 512)]
    refs = [reference(raws[0][1], T.IQ4_XS).double(), torch.cat([reference(r, t) for t, r in raws[:2]]).double(),
            reference(raws[2][1], T.Q8_0).double(), reference(raws[3][1], T.Q4_1).double()]
    spans = [(1, sys.maxsize), (1, sys.maxsize), gguf_quant.INT8_BLOCK32_ROWS, gguf_quant.INT8_BLOCK32_ROWS]
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv("PAGEDSERVE_GGUF_INT8", "1")
    with kernels.use_isa(isa_name) as ops:
        vnni = isa_name in ("avx512", "amx") and int(T.IQ4_XS) in ops.gguf_int8_types()
        avx2 = isa_name == "avx2" and int8_ops(isa_name) is not None
        assert vnni == (int(T.IQ4_XS) in ops.gguf_int8_gemv_types())
        assert (vnni or avx2) == (int(T.Q8_0) in ops.gguf_int8_gemv_types())
        assert avx2 == (int(T.Q4_1) in ops.gguf_int8_gemv_types())
        for w, ref, (low, high), on in zip(weights, refs, spans, [vnni, vnni, vnni or avx2, avx2]):
            choice = kernel_choice(ops, torch.float32, w.qtypes)
            for m in (1, 2, 3, 4, 5, 8, 256, 300):
                int8 = on and low <= m <= high
                assert (choice.path(m) == "int8") == int8, (m, choice)
                y = gguf_linear(x[:m], w, None)
                if int8:
                    parts = [ops.gemm_gguf_int8(x[:m], p, t, None) for t, p in zip(w.qtypes, w.parts)]
                    assert torch.equal(y, torch.cat(parts, dim=1))
                else:
                    torch.testing.assert_close(y.double(), x[:m].double() @ ref.T, rtol=1e-5, atol=1e-5)
