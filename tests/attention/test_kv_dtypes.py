"""`--kv-cache-dtype`: 8-bit and bf16 KV caches store what attention needs. Codes and scales round-trip
within the format's precision, attention over them stays close to float32, block copies carry the scales,
and the embedded model still retrieves a code word planted in a 1,000-token system prompt."""
from __future__ import annotations

import logging
import random

import pytest
import torch

from tests.paged_metadata import build_attention_metadata, scattered_block_tables
from pagedserve import kv_dtypes
from pagedserve.attention import kv_quant
from pagedserve.attention.reference import ReferenceAttentionBackend, gather_kv, write_kv
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.kv_spec import KVCacheSpec
from pagedserve.quality import greedy_continuation
from pagedserve.worker.kv_cache import allocate, allocate_kv_caches, copy_blocks

KV_DTYPES = ["float32", "bfloat16", "fp8_e4m3", "int8"]
# Largest error of one element relative to its row's absolute maximum (int8: half a step of amax / 127) or,
# for fp8 e4m3 (3 mantissa bits), relative to the element itself plus the subnormal step.
INT8_TOL, FP8_REL = 0.5 / 127 + 1e-6, 2.0 ** -4


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantize_round_trip(kv: str) -> None:
    dtype = kv_quant.storage_dtype(kv)
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 50)[:, None, None]
    rows = kv_quant.quantize(x, dtype)
    assert rows.dtype == dtype and rows.shape == (50, 3, 68)
    back = kv_quant.dequantize(rows, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    err = (back - x).abs()
    if kv == "int8":
        assert (err <= INT8_TOL * amax).all()
    else:
        assert (err <= FP8_REL * x.abs() + amax / 448 * 2.0 ** -9).all()
    assert torch.equal(kv_quant.dequantize(kv_quant.quantize(torch.zeros(2, 64), dtype), torch.float32),
                       torch.zeros(2, 64))


@pytest.mark.parametrize("kv,tol", [("bfloat16", 0.01), ("fp8_e4m3", 0.08), ("int8", 0.01)])
def test_attention_over_low_precision_cache_close_to_fp32(kv: str, tol: float) -> None:
    gen = torch.Generator().manual_seed(1)
    seqs = [(0, 9), (20, 1), (37, 3), (5, 1)]  # (context, query): prefill, decode, chunk, decode
    block_size, heads, kv_heads, head_dim = 4, 6, 2, 32
    lens = [c + q for c, q in seqs]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    tables = scattered_block_tables(lens, block_size, num_blocks)
    meta = build_attention_metadata(seqs, tables, block_size)
    n = sum(q for _, q in seqs)
    q = torch.randn(n, heads, head_dim, generator=gen)
    k, v = torch.randn(n, kv_heads, head_dim, generator=gen), torch.randn(n, kv_heads, head_dim, generator=gen)
    context = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    backend = ReferenceAttentionBackend()
    (fp32_cache,) = allocate_kv_caches(1, num_blocks, block_size, kv_heads, head_dim, torch.float32, "cpu")
    (low_cache,) = allocate_kv_caches(1, num_blocks, block_size, kv_heads, head_dim, kv_quant.storage_dtype(kv),
                                      "cpu")
    all_slots = torch.arange(num_blocks * block_size)
    for cache in (fp32_cache, low_cache):  # the earlier context, written through the same path
        write_kv(cache, context[0].reshape(-1, kv_heads, head_dim), context[1].reshape(-1, kv_heads, head_dim),
                 all_slots)
    expected = backend.forward(q, k, v, fp32_cache, meta, head_dim ** -0.5)
    got = backend.forward(q, k, v, low_cache, meta, head_dim ** -0.5)
    assert got.dtype == torch.float32
    assert (got - expected).abs().max().item() < tol * expected.abs().max().item()
    assert (got - expected).abs().max().item() > 0  # the cache really held fewer bits


def test_block_copies_move_scales() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, kv_dtype="int8")
    caches = allocate(spec, 6, torch.device("cpu"))
    assert caches[0].dtype == torch.int8
    assert spec.bytes_per_block == sum(c.numel() * c.element_size() for c in caches) // 6  # scales counted
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(2)) * 5
    tol = INT8_TOL * x.abs().amax(-1, keepdim=True)  # per row (token, head): half a step of its scale
    for c in caches:
        write_kv(c, x, -x, torch.arange(8))  # blocks 0 and 1
    copy_blocks([(0, 4), (1, 5)], caches, caches)  # copy-on-write / swap path
    table = torch.tensor([[4, 5]])
    for c in caches:
        keys, values = gather_kv(c, table, 2, torch.float32)
        assert ((keys[0] - x).abs() <= tol).all() and ((values[0] + x).abs() <= tol).all()
        assert not torch.equal(keys[0], x)  # really int8 codes


def test_bad_kv_cache_dtype_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--kv-cache-dtype 'fp4' is not supported; valid values: auto, float32, "
                                         r"bfloat16, float16, fp8_e4m3, int8"):
        EngineArgs(kv_cache_dtype="fp4").create_engine_config()
    assert EngineArgs(kv_cache_dtype="FP8").create_engine_config().cache.cache_dtype == "fp8_e4m3"
    assert kv_dtypes.resolve("auto", "bfloat16") == "bfloat16"
    from pagedserve.engine.core import EngineCore

    # The compiled backend reads float32, bf16 and 8-bit caches, not float16: asking for both is a start-up
    # error, before loading.
    config = EngineArgs(kv_cache_dtype="float16", attention_backend="cpu").create_engine_config()
    with pytest.raises(ValueError, match="--kv-cache-dtype float16 needs --attention-backend auto or reference"):
        EngineCore(config)


def needle_prompt(tokenizer) -> list[int]:
    # About 1,000 tokens of system prompt with one code word in the middle.
    rng = random.Random(0)
    words = ("the river town market bread morning window garden letter winter road lamp stone field cloud music "
             "table chair paper candle bridge forest summer harbor boat").split()
    filler = [" ".join(rng.choice(words) for _ in range(7)).capitalize() + "." for _ in range(120)]
    system = ("You are a helpful assistant. " + " ".join(filler[:60]) + " The secret code word is PELICAN. "
              + " ".join(filler[60:]))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "What is the secret code word?"}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_needle_in_system_prompt(embedded_model, kv: str) -> None:
    model, tokenizer = embedded_model.model, embedded_model.tokenizer
    ids = needle_prompt(tokenizer)
    assert 950 <= len(ids) <= 1100
    caches = allocate_kv_caches(len(model.model.layers), 70, 16, model.num_kv_heads, model.head_dim,
                                kv_quant.storage_dtype(kv), "cpu")
    text = tokenizer.decode(greedy_continuation(model, ids, caches, 16, max_tokens=10))
    assert "PELICAN" in text, f"{kv}: {text!r}"


def test_needle_with_bf16_model(embedded_model) -> None:
    # bf16 queries: on an AMX CPU the 512-token prefill chunks (the second over the cached first) run the AMX tiles.
    from pagedserve.model.loader import load_model

    model = load_model(None, dtype=torch.bfloat16).model
    ids = needle_prompt(embedded_model.tokenizer)
    for kv in ("bfloat16", "int8"):
        caches = allocate_kv_caches(len(model.model.layers), 70, 16, model.num_kv_heads, model.head_dim,
                                    kv_quant.storage_dtype(kv), "cpu")
        text = embedded_model.tokenizer.decode(greedy_continuation(model, ids, caches, 16, max_tokens=10))
        assert "PELICAN" in text, f"{kv}: {text!r}"


def test_engine_int8_kv_cache(caplog) -> None:
    from pagedserve import LLM, SamplingParams

    with caplog.at_level(logging.INFO, logger="pagedserve.engine.core"):
        llm = LLM(kv_cache_dtype="int8", num_gpu_blocks_override=16)
    assert "KV cache dtype int8: 12240 bytes per token (float32: 46080)" in caplog.text
    assert llm.llm_engine.core.config.cache.cache_dtype == "int8"
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    assert "Paris" in out[0].outputs[0].text


def test_low_precision_kv_quality_bounds(embedded_model, numerics) -> None:
    # Issue 11's targets (1% perplexity on benchmarks/quality.py's text) on a short text, where 37 tokens make
    # perplexity noisy: fp8 measured +1.3% to +1.6% across the kernel variants on one CPU and +2.4% in CI on
    # another (KL 0.0031-0.0033 on both), int8 -1.3% (KL 0.0006). So 3% perplexity and a tight KL, which is
    # the stable measure.
    from pagedserve.quality import score, teacher_forced_logits

    model = embedded_model.model
    text = ("A record is valuable not because it is precise but because it is kept the same way for a long time, "
            "with its method written down, so that small biases can be measured and removed.")
    ids = embedded_model.tokenizer(text)["input_ids"]

    def logits(kv: str) -> torch.Tensor:
        caches = allocate_kv_caches(len(model.model.layers), 4, 16, model.num_kv_heads, model.head_dim,
                                    kv_quant.storage_dtype(kv), "cpu")
        return teacher_forced_logits(model, ids, caches, 16, chunk=8)  # 8-token chunks: most K/V read back

    reference = logits("float32")
    fp32 = score(reference, ids)
    for kv in ("bfloat16", "int8", "fp8_e4m3"):
        q = score(logits(kv), ids, reference=reference)
        numerics[f"kv_{kv}_ppl_ratio"] = q.perplexity / fp32.perplexity
        assert abs(q.perplexity / fp32.perplexity - 1) < 0.03 and q.mean_kl < 0.005, (kv, q, fp32)
