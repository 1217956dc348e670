"""The compiled layer ops and oneDNN linears equal the torch arithmetic they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve import kernels
from pagedserve.model.layers.linear import Linear, find_exact_blocks, onednn_available
from pagedserve.model.layers.norm import RMSNorm

ops = kernels.load()
needs_ops = pytest.mark.skipif(ops is None, reason="CPU kernels could not be built here")


def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@needs_ops
@pytest.mark.parametrize("num_tokens,hidden", [(1, 576), (37, 576), (5, 100)])
def test_rms_norm_and_fused_add(num_tokens: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=gen)
    residual = torch.randn(num_tokens, hidden, generator=gen)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.rand(hidden, generator=gen) + 0.5
    torch.testing.assert_close(norm(x), torch_rms_norm(x, norm.weight, 1e-5))
    expected_res = residual + x
    expected = torch_rms_norm(expected_res, norm.weight, 1e-5)
    got, got_res = norm.forward_residual(x.clone(), residual.clone())
    torch.testing.assert_close(got_res, expected_res)
    torch.testing.assert_close(got, expected)


@needs_ops
def test_rotary_in_place_matches_torch_path() -> None:
    from transformers import LlamaConfig

    from pagedserve.model.layers.rotary import RotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=300)
    rope = RotaryEmbedding(config, 16)
    gen = torch.Generator().manual_seed(0)
    fused = torch.randn(7, (4 + 2 * 2) * 16, generator=gen)
    q, k, _ = fused.split([64, 32, 32], dim=-1)  # non-contiguous views, as the model passes them
    q, k = q.view(7, 4, 16), k.view(7, 2, 16)
    positions = torch.tensor([0, 1, 2, 150, 151, 298, 299])
    rope._cos_sin = None
    torch_q, torch_k = rope.forward.__func__(_TorchPath(rope), positions, q.clone(), k.clone())
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, torch_q)
    torch.testing.assert_close(got_k, torch_k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place


class _TorchPath:
    # Runs RotaryEmbedding.forward with the kernels switched off (max_positions 0 selects the torch path).
    def __init__(self, rope) -> None:
        self.inv_freq, self.attention_scaling, self.max_positions = rope.inv_freq, rope.attention_scaling, 0


@needs_ops
def test_silu_and_mul() -> None:
    from pagedserve.model.layers.activation import SiluAndMul

    x = torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(gate) * up)


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear(bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = Linear(576, 960, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(960, 576, generator=gen) * 0.05)
        if bias:
            layer.bias.copy_(torch.randn(960, generator=gen))
    layer.pack()
    assert layer.packed_weight is not None
    for num_tokens in (1, 16, 300):
        x = torch.randn(num_tokens, 576, generator=gen)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def _q4_1_weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    # fp32 weights the way a GGUF Q4_1 file yields them: per block of 32, fp16 d and m, w = d * q + m.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n * k // 32, 32, generator=gen) * 0.05
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    q = torch.round((x - m) / d).clamp(0, 15)
    return (d * q + m).reshape(n, k)


def _q8_0_weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n * k // 32, 32, generator=gen) * 0.05
    d = (x.abs().amax(1, keepdim=True) / 127).half().float()
    return (d * torch.round(x / d).clamp(-127, 127)).reshape(n, k)


def test_exact_block_recovery() -> None:
    from pagedserve.model.layers.quant import find_q4_1, find_q8_0

    w4, w8 = _q4_1_weights(64, 96), _q8_0_weights(64, 96)
    qs, dm = find_q4_1(w4)
    q = qs.view(64, 3, 16)
    rebuilt = dm[..., :1] * torch.cat((q & 15, q >> 4), dim=-1).float() + dm[..., 1:]
    assert torch.equal(rebuilt.reshape(64, 96), w4)
    qs8, d8 = find_q8_0(w8)
    assert torch.equal((d8.unsqueeze(-1) * qs8.view(64, 3, 32).float()).reshape(64, 96), w8)
    # Plain fp32 weights are not block values: no lossy copy is ever made.
    dense = torch.randn(64, 96)
    assert find_q4_1(dense) is None and find_q8_0(dense) is None
    assert find_q4_1(w4[:, :40].contiguous()) is None  # K not a multiple of the block
    if ops is not None:  # the compiled search finds the same blocks
        for w, fmt, expected in ((w4, "q4_1", (qs, dm)), (w8, "q8_0", (qs8, d8))):
            got = find_exact_blocks(w, (fmt,))
            assert got is not None and all(torch.equal(a, b) for a, b in zip(got[1], expected))
            assert find_exact_blocks(dense, (fmt,)) is None
        assert find_exact_blocks(w8)[0] == "q8_0"  # the default tries both formats


@needs_ops
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 11])
def test_quant_gemm_matches_fp32(num_tokens: int) -> None:
    from pagedserve.model.layers.linear import find_exact_blocks, quant_linear

    gen = torch.Generator().manual_seed(1)
    w4, w8 = _q4_1_weights(80, 576), _q8_0_weights(48, 576)
    bias = torch.randn(80, generator=gen)
    x = torch.randn(num_tokens, 576, generator=gen)
    for w, fmt, b in ((w4, "q4_1", bias), (w8, "q8_0", None)):
        blocks = find_exact_blocks(w, (fmt,))
        assert blocks is not None
        got = quant_linear(x, blocks, b)
        if num_tokens > 8:  # above QUANT_MAX_TOKENS the fp32 path runs
            assert got is None
            got = ops.gemm_q4_1(x, *blocks[1], b) if fmt == "q4_1" else ops.gemm_q8_0(x, *blocks[1], b)
        torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
