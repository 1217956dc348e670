"""`--dtype`: what `auto` picks from the device, and bfloat16 computing what float32 computes, within
bf16's precision (a tiny random model against transformers in float32, and the embedded model)."""
from __future__ import annotations

import pytest
import torch

from tests.model.test_parity import SCHEDULES, make_pair
from tests.paged_metadata import run_paged_schedule
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.model.dtypes import resolve_dtype
from pagedserve.quality import score, teacher_forced_logits
from pagedserve.worker.kv_cache import allocate_kv_caches

CPU = torch.device("cpu")
AMX = frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16"})


def test_auto_dtype_follows_the_cpu(monkeypatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_AUTO_DTYPE", raising=False)
    assert resolve_dtype("auto", CPU, AMX) == (torch.bfloat16, "auto: this CPU multiplies bf16 natively (amx_bf16)")
    assert resolve_dtype("auto", CPU, frozenset({"avx512f", "avx512_bf16"}))[0] == torch.bfloat16
    dtype, why = resolve_dtype("auto", CPU, frozenset({"avx2", "fma", "f16c"}))  # this AMD EPYC, say
    assert dtype == torch.float32 and "neither AMX nor AVX512-BF16" in why
    assert resolve_dtype("float32", CPU, AMX) == (torch.float32, "--dtype float32")
    assert resolve_dtype("bfloat16", CPU, frozenset())[0] == torch.bfloat16
    monkeypatch.setenv("PAGEDSERVE_AUTO_DTYPE", "float32")
    assert resolve_dtype("auto", CPU, AMX)[0] == torch.float32
    monkeypatch.setenv("PAGEDSERVE_AUTO_DTYPE", "fp9")
    with pytest.raises(ValueError, match="PAGEDSERVE_AUTO_DTYPE"):
        resolve_dtype("auto", CPU, AMX)
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16"):
        EngineArgs(dtype="int8").create_engine_config()
    assert EngineArgs().create_engine_config().model.dtype == "auto"


@pytest.mark.parametrize("name", ["llama", "qwen2-tied-linear-rope"])
def test_bf16_tiny_model_close_to_fp32_transformers(name: str) -> None:
    hf_model, ours = make_pair(name)
    ours.to(torch.bfloat16)
    ours.pack_weights()
    chunks = SCHEDULES["chunked-prefill"]
    gen = torch.Generator().manual_seed(1)
    token_ids = [torch.randint(0, 128, (sum(c),), generator=gen).tolist() for c in chunks]
    got = run_paged_schedule(ours, token_ids, chunks, block_size=4)
    with torch.no_grad():
        for ids, g in zip(token_ids, got):
            expected = hf_model(torch.tensor([ids])).logits[0]
            assert g.dtype == torch.bfloat16
            # bf16 keeps 8 bits of mantissa: a relative error of a few 1e-3 per op.
            scale = expected.abs().max().item()
            assert (g.float() - expected).abs().max().item() < 0.03 * scale
            assert (g.float().argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9


def test_bf16_embedded_model_close_to_fp32(embedded_model) -> None:
    from pagedserve.model.loader import load_model

    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
            "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Within "
            "fifty years printers worked in more than two hundred cities, and the price of books fell sharply.")
    ids = embedded_model.tokenizer(text)["input_ids"]
    results = {}
    for loaded in (embedded_model, load_model(None, dtype=torch.bfloat16)):
        model = loaded.model
        param = next(model.parameters())
        caches = allocate_kv_caches(len(model.model.layers), 8, 16, model.num_kv_heads, model.head_dim,
                                    param.dtype, CPU)
        results[param.dtype] = teacher_forced_logits(model, ids, caches, 16, chunk=24)
    q = score(results[torch.bfloat16], ids, reference=results[torch.float32])
    fp32 = score(results[torch.float32], ids)
    assert q.top1_agreement >= 0.9, q
    assert q.mean_kl < 0.01, q
    assert abs(q.perplexity / fp32.perplexity - 1) < 0.015, (q, fp32)  # measured 0.5%, KL 0.0014
