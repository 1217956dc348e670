"""Hugging Face quantized checkpoints (AWQ, GPTQ, compressed-tensors FP8, fp8) load as GGUF blocks.

Each test writes a tiny random Llama checkpoint in the real layout of its format (the packers below follow
the layouts AutoAWQ, AutoGPTQ / GPTQModel, llm-compressor and vLLM document), dequantizes it here with the
formats' own formula, and compares pagedserve's logits with transformers running those dense weights."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from pagedserve import LLM, SamplingParams, kernels
from pagedserve.model import hf_config
from pagedserve.model.hf_config import HFConfig, read_config
from pagedserve.model.hf_quant import Int4Groups, checkpoint_quantization, int4_blocks
from pagedserve.model.layers.gguf_quant import gguf_dequantize, gguf_linear
from pagedserve.model.loader import load_model, load_tokenizer, resolve_model_dir
from pagedserve.model.weight_quant import resolve_quantization
from pagedserve.quality import teacher_forced_logits
from pagedserve.worker.kv_cache import allocate_kv_caches
from tests.tiny_models import random_hf_model

needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="the block kernels could not be built here")
GROUP = 128
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AWQ's GEMM packing: nibble i of a word holds column 8c + AWQ_ORDER[i]
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}
# A small vocabulary (the tokenizer's first ids) keeps the embedding and LM head cheap; the text is random ids.
VOCAB = 2048
TOKEN_IDS = torch.randint(0, VOCAB, (72,), generator=torch.Generator().manual_seed(0)).tolist()


def pack_nibbles(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    # int32 [..., n / 8]: eight 4-bit values per word along the last dim, nibble i = value order[i] of the 8.
    v = values.numpy().astype(np.uint32).reshape(*values.shape[:-1], -1, 8)
    words = sum(v[..., order[i]] << np.uint32(4 * i) for i in range(8))
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def int4_checkpoint(name: str, out_features: int, in_features: int, method: str, group_ids: torch.Tensor,
                    symmetric: bool, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    # Random codes, zeros and fp16 scales of one linear, packed as `method` stores them, and w = (q - z) s.
    num_groups = in_features // GROUP
    codes = torch.randint(0, 16, (in_features, out_features), generator=gen)  # [in, out] as both store them
    zeros = torch.full((num_groups, out_features), 8) if symmetric else torch.randint(
        1, 16, (num_groups, out_features), generator=gen)
    scales = (0.004 + 0.008 * torch.rand(num_groups, out_features, generator=gen)).half()
    dense = ((codes - zeros[group_ids]) * scales[group_ids].float()).t().contiguous()
    if method == "awq":
        tensors = {"qweight": pack_nibbles(codes, AWQ_ORDER), "qzeros": pack_nibbles(zeros, AWQ_ORDER),
                   "scales": scales}
    else:  # gptq: qweight packs along the inputs; format "gptq" stores z - 1, "gptq_v2" z
        stored = (zeros - 1) & 15 if method == "gptq" else zeros
        tensors = {"qweight": pack_nibbles(codes.t().contiguous(), list(range(8))).t().contiguous(),
                   "qzeros": pack_nibbles(stored, list(range(8))), "scales": scales,
                   "g_idx": group_ids.to(torch.int32)}
    return {f"{name}.{k}": v for k, v in tensors.items()}, dense


def fp8_checkpoint(name: str, weight: torch.Tensor, block: bool, scale_name: str) -> tuple[dict, torch.Tensor]:
    # FP8 e4m3 weights with one scale per row or per 128 x 128 block, and w = fp8 * scale.
    rows, cols = weight.shape
    if block:
        amax = weight.reshape(rows // 128, 128, cols // 128, 128).abs().amax(dim=(1, 3))
        scale = amax / 448
        expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    else:
        scale = (weight.abs().amax(dim=1, keepdim=True) / 448).bfloat16()  # llm-compressor keeps the model dtype
        expanded = scale.float()
    fp8 = (weight / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {f"{name}.weight": fp8, f"{name}.{scale_name}": scale}, fp8.float() * expanded


FORMATS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True},
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
                       "checkpoint_format": "gptq"},
    "gptq_v2": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq_v2"},
    "fp8-channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head"]},
    "fp8-block": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                           "block_structure": [128, 128]}}}, "ignore": ["lm_head"]},
    "fp8-vllm": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}
# The block type each format maps to, and the largest weight error of that mapping, measured over the
# checkpoints below (printed with the numerics): Q4_0 is exact, Q4_1 rounds m = -z s to fp16
# (<= s / 128), Q8_0 requantizes each FP8 block of 32 (<= its max / 254 plus fp16 rounding of d).
LOGIT_TOLERANCE = {"Q4_0": 1e-4, "Q4_1": 0.05, "Q8_0": 0.15}
EXPECTED_TYPE = {"awq": "Q4_1", "gptq": "Q4_0", "gptq-act-order": "Q4_1", "gptq_v2": "Q4_1", "fp8-channel": "Q8_0",
                 "fp8-block": "Q8_0", "fp8-vllm": "Q8_0"}


@pytest.fixture(scope="module")
def tokenizer():
    model_dir = resolve_model_dir(None, weights=False)[0]  # the embedded model's tokenizer, for the checkpoints
    return load_tokenizer(model_dir, read_config(model_dir))


@pytest.fixture(autouse=True)
def in_process_configs(tokenizer, tmp_path, monkeypatch) -> None:
    # Each checkpoint's config.json is new to the config cache; resolving it in this process (transformers is
    # already imported here) instead of in a child (model/hf_config.py) saves a transformers import per load.
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hf_config, "_resolve_with_transformers",
                        lambda path: transformers.AutoConfig.from_pretrained(path).to_dict())


@pytest.fixture(scope="module")
def reference_model(tokenizer):
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=VOCAB,
                                      max_position_embeddings=256, tie_word_embeddings=False,
                                      eos_token_id=tokenizer.eos_token_id)
    model = random_hf_model(config, scale=0.05)
    with torch.no_grad():  # the checkpoint stores its unquantized tensors in fp16, as quantized checkpoints do
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


def write_checkpoint(fmt: str, hf, tokenizer, path) -> dict[str, torch.Tensor]:
    # Writes the checkpoint into hf's shapes at `path`; returns each projection's dequantized weight (HF names),
    # which are also copied into hf (the reference).
    gen = torch.Generator().manual_seed(len(fmt))
    method = FORMATS[fmt]["quant_method"]
    quantized = tuple(f"{p}.weight" for p in PROJECTIONS)
    tensors = {n: p.half() for n, p in hf.state_dict().items() if not n.endswith(quantized)}
    dense: dict[str, torch.Tensor] = {}
    for layer in range(hf.config.num_hidden_layers):
        orders: dict[int, torch.Tensor] = {}  # act-order: inputs of one size in one layer share a random order
        for proj in PROJECTIONS:
            name = f"model.layers.{layer}.{proj}"
            out_features, in_features = hf.get_parameter(f"{name}.weight").shape
            if method in ("awq", "gptq"):
                group_ids = torch.arange(in_features) // GROUP
                if FORMATS[fmt].get("desc_act"):
                    if proj not in ("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
                        orders[in_features] = torch.randperm(in_features, generator=gen)
                    group_ids = torch.empty_like(group_ids)
                    group_ids[orders[in_features]] = torch.arange(in_features) // GROUP
                stored_method = FORMATS[fmt].get("checkpoint_format", method)
                packed, w = int4_checkpoint(name, out_features, in_features, stored_method, group_ids,
                                            FORMATS[fmt].get("sym", False), gen)
            else:
                weight = 0.05 * torch.randn(out_features, in_features, generator=gen)
                scale_name = "weight_scale_inv" if method == "fp8" else "weight_scale"
                packed, w = fp8_checkpoint(name, weight, fmt != "fp8-channel", scale_name)
            tensors.update(packed)
            dense[f"{name}.weight"] = w
    if method == "compressed-tensors":  # a static activation scale, which serving ignores
        tensors["model.layers.0.self_attn.q_proj.input_scale"] = torch.ones(1)
    hf.load_state_dict(dense, strict=False)
    path.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config = hf.config.to_dict() | {"quantization_config": FORMATS[fmt], "torch_dtype": "float16",
                                    "architectures": ["LlamaForCausalLM"]}
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(path)
    return dense


def _logits(loaded, ids: list[int], chunk: int) -> torch.Tensor:
    m = loaded.model
    caches = allocate_kv_caches(len(m.model.layers), 16, 16, m.num_kv_heads, m.head_dim, torch.float32,
                                torch.device("cpu"))
    return teacher_forced_logits(m, ids, caches, 16, chunk)


def _block_weight(blocks) -> torch.Tensor:
    # The fused weight the blocks hold, in the checkpoint's input order.
    w = gguf_dequantize(blocks)
    if blocks.in_order is None:
        return w
    out = torch.empty_like(w)
    out[:, blocks.in_order] = w
    return out


@needs_kernels
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_checkpoint_matches_dequantized_transformers(fmt, reference_model, tokenizer, tmp_path,
                                                               numerics) -> None:
    dense = write_checkpoint(fmt, reference_model, tokenizer, tmp_path / fmt)
    loaded = load_model(str(tmp_path / fmt), dtype=torch.float32, quantization=None)
    assert loaded.quantization == FORMATS[fmt]["quant_method"]

    as_blocks: dict[str, torch.Tensor] = {}  # the weights the blocks hold, per checkpoint tensor
    worst = 0.0
    for layer in range(len(loaded.model.model.layers)):
        for module_name, sources in FUSED.items():
            kind, blocks = loaded.model.get_submodule(f"model.layers.{layer}.{module_name}").exact_blocks
            assert kind == "gguf" and blocks.type_names() == EXPECTED_TYPE[fmt]
            assert (blocks.in_order is not None) == bool(FORMATS[fmt].get("desc_act"))
            names = [f"model.layers.{layer}.{s}.weight" for s in sources]
            want, got = torch.cat([dense[n] for n in names]), _block_weight(blocks)
            as_blocks.update(zip(names, got.split([dense[n].shape[0] for n in names])))
            err = (got - want).abs().max()
            worst = max(worst, err.item())
            if EXPECTED_TYPE[fmt] == "Q4_0":
                assert torch.equal(got, want)
            elif EXPECTED_TYPE[fmt] == "Q4_1":
                assert err <= 0.012 / 128  # m = -z s within half an fp16 ulp of 15 s; s < 0.012
            else:
                assert err <= want.abs().max() * (1 / 254 + 1 / 1024)  # half a Q8_0 step, d rounded to fp16
    numerics[f"hf_quant_{fmt}_weight_err"] = worst

    with torch.no_grad():
        want = reference_model(torch.tensor([TOKEN_IDS])).logits[0]  # the checkpoint's dequantized weights
        reference_model.load_state_dict(as_blocks, strict=False)
        want_blocks = reference_model(torch.tensor([TOKEN_IDS])).logits[0]  # the weights the blocks hold
    top2 = want.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05  # positions without a near-tie
    for chunk in (4, len(TOKEN_IDS)):  # the block GEMM (decode) and dequantized tiles (prefill)
        got = _logits(loaded, TOKEN_IDS, chunk)
        numerics[f"hf_quant_{fmt}_logits_chunk{chunk}"] = (got - want).abs().max().item()
        # measured on an AVX-512 EPYC: vs the blocks' own weights <= 3e-6; vs the exact dequantization 3e-6
        # (Q4_0), 0.017 (AWQ) / 0.008 (GPTQ act-order) / 0.012 (GPTQ v2) (Q4_1), 0.070-0.074 (Q8_0), with
        # logits up to ~4.5
        torch.testing.assert_close(got, want_blocks, atol=1e-4, rtol=0)
        torch.testing.assert_close(got, want, atol=LOGIT_TOLERANCE[EXPECTED_TYPE[fmt]], rtol=0)
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@needs_kernels
def test_none_dequantizes_exactly_and_llm_generates(reference_model, tokenizer, tmp_path) -> None:
    # --quantization none: every weight dequantized, no blocks; the engine's greedy tokens equal transformers'.
    write_checkpoint("gptq-act-order", reference_model, tokenizer, tmp_path / "gptq")
    dense = load_model(str(tmp_path / "gptq"), dtype=torch.float32, quantization="none")
    assert dense.quantization == "none"
    assert all(m.exact_blocks is None or m.exact_blocks[0] != "gguf" for m in dense.model.modules()
               if hasattr(m, "exact_blocks"))
    with torch.no_grad():
        want = reference_model(torch.tensor([TOKEN_IDS])).logits[0]
    torch.testing.assert_close(_logits(dense, TOKEN_IDS, 32), want, atol=1e-4, rtol=0)

    prompt, hf_tokens = TOKEN_IDS[:12], []
    with torch.no_grad():
        for _ in range(8):
            hf_tokens.append(int(reference_model(torch.tensor([prompt + hf_tokens])).logits[0, -1].argmax()))
    llm = LLM(model=str(tmp_path / "gptq"), kv_cache_memory_bytes=1 << 22)  # blocks: gptq by default
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == hf_tokens


@needs_kernels
def test_act_order_parts_share_one_input_order() -> None:
    # Parts of a fused linear take the first part's input order; a part whose groups do not fall into whole
    # blocks of 32 under it leaves the layer dense (None).
    gen = torch.Generator().manual_seed(0)

    def part(order: torch.Tensor) -> Int4Groups:
        group_ids = torch.empty(256, dtype=torch.int64)
        group_ids[order] = torch.arange(256) // GROUP
        return Int4Groups(torch.randint(0, 16, (40, 256), generator=gen, dtype=torch.uint8),
                          torch.randint(0, 16, (40, 2), generator=gen, dtype=torch.int16),
                          (0.01 * torch.rand(40, 2, generator=gen)).half().float(), group_ids)

    order = torch.randperm(256, generator=gen)
    parts = [part(order), part(order)]
    w = int4_blocks(parts)
    assert w.type_names() == "Q4_1" and torch.equal(w.in_order[:GROUP], order[:GROUP].sort().values)
    held = _block_weight(w)  # in the checkpoint's input order
    assert (held - torch.cat([p.dequantize() for p in parts])).abs().max() <= 0.01 / 128
    x = torch.randn(70, 256, generator=gen)
    for m in (1, 5, 70):  # the block GEMM and dequantized tiles, both after the gather of x
        torch.testing.assert_close(gguf_linear(x[:m], w, None), x[:m] @ held.T, atol=1e-5, rtol=1e-5)
    assert int4_blocks([part(order), part(torch.randperm(256, generator=gen))]) is None


def test_unsupported_quantization_is_a_clear_error() -> None:
    def scheme(**config):
        return checkpoint_quantization(HFConfig(quantization_config=config))

    assert scheme(**FORMATS["gptq"]).zero_offset == 1 and scheme(**FORMATS["gptq_v2"]).zero_offset == 0
    assert checkpoint_quantization(HFConfig()) is None
    for bad, what in [({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
                      (FORMATS["awq"] | {"version": "gemv"}, "awq with bits 4, version gemv"),
                      (FORMATS["gptq"] | {"bits": 8}, "gptq with bits 8"),
                      ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                        "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
                       "compressed-tensors format pack-quantized")]:
        with pytest.raises(ValueError, match=f"{what}.* is not supported; supported: awq"):
            scheme(**bad)
    with pytest.raises(ValueError, match="group_size 100 is not supported"):
        scheme(**FORMATS["awq"] | {"group_size": 100})
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="--quantization awq needs a awq checkpoint .* this model has a gptq "
                                         "checkpoint; for this model use one of: gptq, none"
                                         if kernels.load() is not None else "--quantization awq"):
        resolve_quantization("awq", "gptq", torch.float32, cpu)
    with pytest.raises(ValueError, match="--quantization int8 quantizes float Hugging Face checkpoints, not a fp8"):
        resolve_quantization("int8", "fp8", torch.float32, cpu)
    assert resolve_quantization(None, "awq", torch.float16, cpu) == "none"  # unset never fails
    assert resolve_quantization("none", "awq", torch.float32, cpu) == "none"
