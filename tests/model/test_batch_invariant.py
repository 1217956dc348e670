"""Batch-invariant linears (docs/batch_invariance.md): in that mode a row of y = x W^T is bit for bit the same
whatever the number of rows of x and whatever the other rows hold, for every GGUF block type (one row-independent
kernel at every row count: layers/gguf_quant.py) and for dense float32 / bf16 weights (fixed blocks of rows:
layers/linear.py). The default dispatcher changes kernels with the row count, which is what this mode removes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve import kernels
from pagedserve.model.layers import gguf_quant
from pagedserve.model.layers.gguf_quant import GGUFWeight, gguf_linear
from pagedserve.model.layers.linear import INVARIANT_ROWS, dense_linear, pack_weight
from tests.model.test_gguf_blocks import ISAS, TYPES, random_blocks

pytestmark = pytest.mark.skipif(not ISAS, reason="the compiled kernels could not be built here")

# Row counts that cross every boundary of the default dispatch: 1-row decode, the table kernels' 4 rows, int8's
# drivers (few-row, 5-31, tiles from 32), the 8-row passes, the tiles from 65; INVARIANT_ROWS blocks, padded tails.
ROW_COUNTS = [1, 2, 3, 4, 5, 8, 9, 17, 31, 32, 64, 65, 100]
DTYPES = [torch.float32, torch.bfloat16]


def rows_alone_and_together(linear, x: torch.Tensor) -> list[tuple[int, int]]:
    # (m, r) for every row r of an m-row call that differs from row r multiplied alone; rows of other content
    # in front of it as well (row 0 of x placed after 0..m-1 other rows).
    alone = torch.cat([linear(x[r:r + 1]) for r in range(x.shape[0])])
    bad = []
    for m in ROW_COUNTS:
        y = linear(x[:m])
        bad += [(m, r) for r in range(m) if not torch.equal(y[r], alone[r])]
        shifted = linear(torch.cat([x[1:m], x[:1]]))  # row 0 last, behind m - 1 others
        if not torch.equal(shifted[m - 1], alone[0]):
            bad.append((m, -1))
    return bad


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_rows_independent_of_the_batch(isa_name: str, qtype, monkeypatch) -> None:
    rng = np.random.default_rng(int(qtype))
    cols = 512
    w = GGUFWeight((int(qtype),), (torch.from_numpy(random_blocks(qtype, 40, cols, rng)),), cols)
    bias = torch.from_numpy(rng.standard_normal(40).astype(np.float32))
    x32 = torch.from_numpy(rng.standard_normal((max(ROW_COUNTS), cols)).astype(np.float32))
    for int8 in (False, True):  # with the int8 kernel allowed, the mode takes it at every row count
        monkeypatch.setenv("PAGEDSERVE_GGUF_INT8", "1" if int8 else "0")
        with kernels.use_isa(isa_name):
            for dtype in DTYPES:
                x = x32.to(dtype)
                bad = rows_alone_and_together(lambda v: gguf_linear(v, w, bias, invariant=True), x)
                assert not bad, (isa_name, qtype.name, dtype, int8, bad[:8])


@pytest.mark.parametrize("isa_name", ISAS)
def test_invariant_paths_are_one_kernel(isa_name: str, monkeypatch) -> None:
    # The mode's choice per weight: int8 where the default takes it for some row counts (then only gguf_int8.h's
    # driver, which the rows test above checks), except Q4_1 and Q8_0 without VNNI (avx2's few-row kernel only: the
    # driver has no Q8_0 there and its Q4_1 is slower), else gemm_gguf; never the amx kernel or dequantized tiles.
    monkeypatch.setenv("PAGEDSERVE_GGUF_INT8", "1")
    ops = kernels.load_isa(isa_name)
    for dtype in DTYPES:
        for qtype in TYPES:
            choice = gguf_quant.kernel_choice(ops, dtype, (int(qtype),))
            paths = {choice.path(m, invariant=True) for m in range(1, 600, 7)}
            driver = bool(ops.gguf_int8_types(True)) or int(qtype) not in gguf_quant.INT8_BLOCK32_TYPES
            assert paths == {"int8" if choice.int8_max_rows and driver else "gemv"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1536, 576), (2048, 1024)])
def test_dense_rows_independent_of_the_batch(dtype, shape) -> None:
    torch.manual_seed(0)
    in_features, out_features = shape
    weight = (torch.randn(out_features, in_features) * 0.05).to(dtype)
    packed = pack_weight(weight)
    bias = torch.randn(out_features).to(dtype)
    x = torch.randn(max(ROW_COUNTS), in_features).to(dtype)
    linear = lambda v: dense_linear(v, weight, packed, bias, invariant=True)  # noqa: E731
    assert not rows_alone_and_together(linear, x)
    # still x W^T + b: every row as torch computes it alone, to rounding
    ref = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(linear(x).double(), ref, rtol=tol, atol=tol)
    assert linear(x[:INVARIANT_ROWS + 3]).shape == (INVARIANT_ROWS + 3, out_features)
    assert linear(x[:6].reshape(2, 3, in_features)).shape == (2, 3, out_features)
