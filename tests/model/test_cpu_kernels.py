"""The compiled layer ops and oneDNN linears equal the torch arithmetic they replace, in every ISA variant of
the kernels this CPU runs (the portable ones too); how a variant is chosen."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pagedserve import kernels
from pagedserve.kernels import isa
from pagedserve.model.layers.linear import Linear, onednn_available
from pagedserve.model.layers.norm import RMSNorm

ops = kernels.load()
# This CPU's variant and the portable baseline (kernels.parity_isas); none (so the parametrized tests are
# skipped) when the kernels cannot be built.
ISAS = kernels.parity_isas()


@pytest.fixture(params=ISAS)
def variant_ops(request):
    # One variant's ops, and this process's kernel calls (the layers' fast paths) routed to it for the test.
    with kernels.use_isa(request.param) as variant:
        yield variant


def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("num_tokens,hidden", [(1, 576), (37, 576), (5, 100)])
def test_rms_norm_and_fused_add(variant_ops, num_tokens: int, hidden: int) -> None:
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


def test_rotary_in_place_matches_torch_path(variant_ops) -> None:
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
    torch_q, torch_k = rope._rotate(positions, q.clone(), k.clone())
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, torch_q)
    torch.testing.assert_close(got_k, torch_k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place


def test_silu_and_mul(variant_ops) -> None:
    from pagedserve.model.layers.activation import SiluAndMul

    x = torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(gate) * up)


def test_bf16_layer_ops_round_float32_results(variant_ops) -> None:
    # bf16 in and out, float32 inside: each output is the float32 result of the same (bf16-exact) inputs,
    # rounded once (relative error <= 2^-9), where torch's bf16 ops round after every step.
    from pagedserve.model.layers.activation import SiluAndMul
    from pagedserve.model.layers.rotary import RotaryEmbedding
    from transformers import LlamaConfig

    gen = torch.Generator().manual_seed(5)
    bf = lambda *shape: torch.randn(*shape, generator=gen).bfloat16()  # noqa: E731

    def close(got: torch.Tensor, expected: torch.Tensor) -> None:
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected, rtol=2 ** -8, atol=1e-6)

    x, residual = bf(5, 576), bf(5, 576)
    assert kernels.ops_for(x, kernels.LAYER_DTYPES) is variant_ops  # the layers below take the kernels
    norm = RMSNorm(576, 1e-5, dtype=torch.bfloat16)
    norm.weight.data = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    w32 = norm.weight.float()
    close(norm(x), torch_rms_norm(x.float(), w32, 1e-5))
    got, got_res = norm.forward_residual(x.clone(), residual.clone())
    res = (residual.float() + x.float()).bfloat16()  # the residual stream is stored in bf16
    assert torch.equal(got_res, res)
    close(got, torch_rms_norm(res.float(), w32, 1e-5))
    gate_up = bf(9, 2 * 96) * 4
    gate, up = gate_up.float().chunk(2, dim=-1)
    close(SiluAndMul()(gate_up), F.silu(gate) * up)
    rope = RotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=300), 16)
    q, k, positions = bf(3, 4, 16), bf(3, 2, 16), torch.tensor([0, 7, 299])
    expected_q, expected_k = rope._rotate(positions, q.float(), k.float())
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # the in-place kernel ran
    close(got_q, expected_q)
    close(got_k, expected_k)


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


def test_linear_stays_float32_when_onednn_would_round() -> None:
    # ONEDNN_DEFAULT_FPMATH_MODE=BF16 makes oneDNN round float32 inputs to bf16 where the CPU has bf16 (logits
    # of the embedded model move by ~0.5). The startup probe then keeps float32 linears off the packed path;
    # on CPUs without bf16 oneDNN ignores the mode and the packed path stays. Either way: float32 results.
    code = ("import torch, torch.nn.functional as F\n"
            "from pagedserve.model.layers.linear import Linear, onednn_keeps_fp32\n"
            "g = torch.Generator().manual_seed(0)\n"
            "layer = Linear(576, 960, bias=False)\n"
            "with torch.no_grad(): layer.weight.copy_(torch.randn(960, 576, generator=g))\n"
            "layer.pack()\n"
            "x = torch.randn(64, 576, generator=g)\n"
            "exact = (x.double() @ layer.weight.double().T)\n"
            "err = ((layer(x).double() - exact).abs().max() / exact.abs().max()).item()\n"
            "print(onednn_keeps_fp32(), layer.packed_weight is None, err)\n")
    env = {**os.environ, "ONEDNN_DEFAULT_FPMATH_MODE": "BF16"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    keeps, unpacked, err = out.stdout.split()
    assert float(err) < 1e-5, out.stdout
    assert (keeps == "True") != (unpacked == "True"), out.stdout  # the probe decides the path
    if keeps == "False":
        assert "rounds through a lower precision" in out.stderr


AVX2_CPU = frozenset({"sse2", "avx", "avx2", "fma", "f16c"})
AVX512_CPU = AVX2_CPU | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
AMX_CPU = AVX512_CPU | {"amx_tile", "amx_bf16", "amx_int8"}


def test_choose_variant() -> None:
    names = lambda vs: [v.name for v in vs]  # noqa: E731
    assert names(isa.choose("auto", AMX_CPU, "x86_64")) == ["amx", "avx512", "avx2", "baseline"]
    assert names(isa.choose("auto", AMX_CPU - {"avx512_bf16"}, "x86_64")) == ["avx512", "avx2", "baseline"]
    assert names(isa.choose("auto", AVX512_CPU, "x86_64")) == ["avx512", "avx2", "baseline"]
    assert names(isa.choose("auto", AVX2_CPU, "x86_64")) == ["avx2", "baseline"]
    assert names(isa.choose("auto", frozenset(), "x86_64")) == ["baseline"]
    assert names(isa.choose("auto", frozenset({"asimd", "fp"}), "aarch64")) == ["baseline"]
    assert names(isa.choose("avx2", AVX512_CPU, "x86_64")) == ["avx2"]
    assert names(isa.choose("baseline", AVX2_CPU, "x86_64")) == ["baseline"]
    with pytest.raises(ValueError, match=r"'avx512': this CPU lacks avx512bw avx512dq avx512f avx512vl; "
                                         r"it can use: auto, avx2, baseline"):
        isa.choose("avx512", AVX2_CPU, "x86_64")
    with pytest.raises(ValueError, match=r"'avx2' is not a kernel variant .* this CPU can use: auto, baseline"):
        isa.choose("avx2", frozenset({"asimd"}), "aarch64")
    with pytest.raises(ValueError, match=r"'sse9' is not a kernel variant"):
        isa.choose("sse9", AVX512_CPU, "x86_64")
    for v in isa.variants("x86_64"):  # a cached build must run on any CPU with the variant's flags
        assert not any("march" in f or "native" in f for f in kernels._cflags(v))


@pytest.mark.parametrize("name", ["avx512", "amx"])
def test_variant_compiles_without_the_cpu(tmp_path, name: str) -> None:
    # The AVX-512 paths (attention tile, block GEMMs, int8 and bf16 GEMMs) and the AMX kernel must compile on a
    # build machine that cannot run them; only the files with such paths, without code generation, to keep it to
    # seconds.
    if ops is None or name in kernels.runnable_isas():
        pytest.skip(f"no compiler, or the {name} variant is built and tested on this CPU")
    csrc = [s for s in kernels._SOURCES
            if s.endswith(("paged_attention.cpp", "gguf_gemm.cpp", "gguf_amx.cpp", "gguf_int8.cpp",
                           "gguf_bf16.cpp"))]
    kernels.syntax_check(name, csrc)
    broken = tmp_path / "broken.cpp"  # and the check can fail
    broken.write_text("#include <immintrin.h>\nvoid f() { _tile_no_such_intrinsic(0); }\n")
    with pytest.raises(RuntimeError, match=f"{name} variant does not compile"):
        kernels.syntax_check(name, [str(broken)])


def test_baseline_equals_chosen_variant() -> None:
    # The portable build computes what this CPU's variant computes (the same sources, other vector code).
    if len(ISAS) < 2:
        pytest.skip("this CPU runs only the baseline variant, or no kernels")
    chosen, base = kernels.load_isa(ISAS[0]), kernels.load_isa("baseline")
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 256, generator=gen), torch.randn(256, generator=gen)
    torch.testing.assert_close(chosen.rms_norm(x, w, 1e-5), base.rms_norm(x, w, 1e-5), atol=1e-6, rtol=1e-5)
    gate_up = torch.randn(7, 2 * 96, generator=gen)
    torch.testing.assert_close(chosen.silu_and_mul(gate_up), base.silu_and_mul(gate_up), atol=1e-6, rtol=1e-5)
    from pagedserve.model.weight_quant import quantize_q8_0

    blocks = quantize_q8_0(torch.randn(64, 256, generator=gen)).parts[0]
    torch.testing.assert_close(chosen.gemm_gguf(x, blocks, 8, None), base.gemm_gguf(x, blocks, 8, None),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa_name", ISAS)
def test_variant_library_targets_its_isa(isa_name: str) -> None:
    variant_lib = kernels.load_isa(isa_name)
    assert variant_lib.compiled_isa() == isa_name
    assert variant_lib is getattr(torch.ops, f"pagedserve_{isa_name}")


@pytest.mark.skipif(ops is None, reason="CPU kernels could not be built here")
def test_env_forces_variant(monkeypatch, caplog) -> None:
    monkeypatch.setattr(kernels, "_state", {})  # a fresh process's choice, restored afterwards
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "baseline")
    with caplog.at_level("INFO", logger="pagedserve.kernels"):
        assert kernels.load() is torch.ops.pagedserve_baseline
    assert kernels.selected_isa() == "baseline"
    assert "baseline variant (forced by PAGEDSERVE_CPU_ISA)" in caplog.text
    # Forcing a variant the CPU lacks is a start-up error, not a fallback.
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset())
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "avx2" if "avx2" in ISAS else "sse9")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_ISA="):
        kernels.load()
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "auto")
    assert kernels.load() is torch.ops.pagedserve_baseline and kernels.selected_isa() == "baseline"


@pytest.mark.skipif(ops is None, reason="CPU kernels could not be built here")
def test_built_library_loads_without_cpp_extension() -> None:
    # This process built or loaded the library, so a new process finds it and loads it directly.
    code = ("import sys; from pagedserve import kernels; assert kernels.load() is not None; "
            "print('torch.utils.cpp_extension' in sys.modules, kernels.selected_isa())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", kernels.selected_isa()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_picks_torchs_index(variant_ops, dtype) -> None:
    # Greedy sampling's argmax (sample/sampler.py): the first maximum, the first NaN if any, 0 for all -inf.
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(9, 1003, generator=gen) * 8).to(dtype)
    logits[1, 17] = logits[1, 500] = logits[1, 1002] = 1e4  # ties: the first one
    logits[2, :] = -float("inf")
    logits[3, 40] = float("nan")
    logits[3, 900] = float("nan")
    logits[3, 7] = 1e4
    logits[4, :] = 3.0  # all equal
    logits[5, 1002] = float("inf")
    logits[6, 0] = 1e4
    wide = torch.zeros(9, 1100, dtype=dtype)
    wide[:, :1003] = logits
    for x in (logits, wide[:, :1003]):  # rows at the vocab size, and rows further apart
        got = variant_ops.argmax_rows(x)
        assert got.dtype == torch.int64
        assert got.tolist() == x.argmax(dim=-1).tolist() == [got[0].item(), 17, 0, 40, 0, 1002, 0, *got[7:].tolist()]
    with pytest.raises(RuntimeError, match="Float or BFloat16"):
        variant_ops.argmax_rows(torch.zeros(2, 3, dtype=torch.float16))
