"""`--quantization`: weights that stay quantized in memory, one resident copy each.

    gguf  (the default for GGUF files) every Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / IQ4_XS tensor is
          copied from the file as its raw blocks, its only resident copy (model/gguf_weights.py); no fp32 form
          is built. A few rows multiply through the block GEMM (up to 4-64 by type, dtype and kernel
          variant); larger batches dequantize tiles of at most 8 MB into a scratch buffer for torch's GEMM
          or multiply through the AMX kernel (layers/gguf_quant.py). The
          embedding gathers and dequantizes only the rows it reads; a tied LM head multiplies by the same
          blocks. Tensors of other GGUF types (F16, BF16, Q2_K, ...) stay fp32.
    int8  weight-only int8 for float32 / bfloat16 Hugging Face checkpoints: each weight is quantized at load
          into GGUF Q8_0 blocks (int8 codes with one fp16 scale per 32 inputs, finer than per channel, the
          bytes a GGUF file would hold) and runs through the same dispatcher as a GGUF file's weights.
    awq, gptq, compressed-tensors, fp8  (the default for such Hugging Face checkpoints: config.json's
          quantization_config) the checkpoint's 4-bit groups become Q4_0 / Q4_1 blocks and its FP8 weights
          Q8_0 blocks at load (model/hf_quant.py), multiplied as gguf's are.
    none  dequantized fp32 (or --dtype) weights, as loaded; a quantized Hugging Face checkpoint is
          dequantized exactly.

Every method but none runs with --dtype float32 or bfloat16 (so `auto` keeps the blocks on CPUs with AMX,
multiplied in bf16 by the AMX kernel; layers/gguf_quant.py) and needs the compiled kernels.
Asking for them otherwise is a start-up error naming the flag. Leaving --quantization unset never fails: it
falls back to none where blocks cannot run.
"""
from __future__ import annotations

import gc
import logging

import torch
from torch import nn

from pagedserve import kernels
from pagedserve.config import QUANTIZATIONS
from pagedserve.malloc import release_free_memory
from pagedserve.model.layers.gguf_quant import GGUFWeight, gguf_dequantize, gguf_embedding
from pagedserve.model.layers.linear import Linear, dense_linear, quant_linear

logger = logging.getLogger(__name__)


def resolve_quantization(requested: str | None, stored: str | None, dtype: torch.dtype, device: torch.device) -> str:
    # stored: how the checkpoint holds its weights: "gguf" (a GGUF file), a Hugging Face quant_method (awq,
    # gptq, compressed-tensors, fp8: model/hf_quant.py) or None (float weights, which int8 can quantize).
    own = stored or "int8"  # the one block method this checkpoint takes
    runnable = device.type == "cpu" and kernels.load() is not None and dtype in (torch.float32, torch.bfloat16)
    if requested is None:
        return stored if stored is not None and runnable else "none"
    if requested not in QUANTIZATIONS:
        raise ValueError(f"--quantization {requested!r} is not supported; valid values: {', '.join(QUANTIZATIONS)}")
    valid = ", ".join([own, "none"] if runnable else ["none"])
    if requested not in (own, "none"):
        held = "a GGUF file" if stored == "gguf" else f"a {stored} checkpoint" if stored else "float weights"
        if requested == "gguf":
            why = "needs a GGUF file"
        elif requested == "int8":
            why = f"quantizes float Hugging Face checkpoints, not {held}"
        else:
            why = f"needs a {requested} checkpoint (config.json quantization_config), this model has {held}"
        raise ValueError(f"--quantization {requested} {why}; for this model use one of: {valid}")
    if requested != "none" and not runnable:
        raise ValueError(f"--quantization {requested} needs --dtype float32 or bfloat16 on CPU with the compiled kernels "
                         f"(here: {str(dtype).removeprefix('torch.')} on {device.type}, kernels "
                         f"{'on' if kernels.load() is not None else 'unavailable'}); valid values here: {valid}")
    return requested


def quantize_q8_0(weight: torch.Tensor) -> GGUFWeight:
    # GGUF Q8_0 blocks of a dense [N, K] weight (lossy; K a multiple of 32), written by gguf-py's quantizer:
    # per 32 inputs an fp16 scale amax / 127 and 32 int8 codes, the bytes a GGUF file would hold.
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    raw = quantize(weight.detach().float().contiguous().numpy(), GGMLQuantizationType.Q8_0)
    return GGUFWeight((int(GGMLQuantizationType.Q8_0),), (torch.from_numpy(raw),), weight.shape[1])


class BlockEmbedding(nn.Module):
    # An embedding table held only as GGUF blocks: a lookup dequantizes the rows it reads.
    def __init__(self, blocks, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.blocks = blocks  # ("gguf", GGUFWeight)
        self.dtype = dtype  # the model's activations
        self.weight = None  # no dense table; compute_logits multiplies through the blocks

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return gguf_embedding(self.blocks[1], input_ids, self.dtype)


def apply_quantization(model: nn.Module, method: str) -> None:
    # After load_weights. Frees the dense copies of quantized weights.
    if method == "none":
        return
    dense_before = _weight_bytes(model)
    num_quantized, num_linear = 0, 0
    for m in model.modules():
        if not isinstance(m, Linear):
            continue
        num_linear += 1
        if method == "int8" and m.weight is not None and m.weight.shape[1] % 32 == 0:
            m.exact_blocks = ("gguf", quantize_q8_0(m.weight))
        if m.exact_blocks is not None:
            m.weight, m.packed_weight = None, None
            num_quantized += 1
    embed = model.model.embed_tokens
    if method == "int8" and model.lm_head is None and embed.weight is not None and embed.weight.shape[1] % 32 == 0:
        model._lm_head_blocks = ("gguf", quantize_q8_0(embed.weight))
    if isinstance(embed, BlockEmbedding):
        pass  # loaded as blocks (model/gguf_weights.py)
    elif model.lm_head is None and model._lm_head_blocks is not None:  # tied: one block table serves both
        model.model.embed_tokens = BlockEmbedding(model._lm_head_blocks, embed.weight.dtype)
        model._lm_head_packed = None
    elif model.lm_head is not None:
        model._lm_head_packed, model._lm_head_blocks = model.lm_head.packed_weight, model.lm_head.exact_blocks
    gc.collect()
    release_free_memory()
    logger.info("quantization %s: %d of %d linear weights kept only as blocks%s; weights %.0f MB (before: %.0f MB)",
                method, num_quantized, num_linear,
                ", embedding too" if isinstance(model.model.embed_tokens, BlockEmbedding) else "",
                _weight_bytes(model) / 1e6, dense_before / 1e6)


def block_logits(hidden: torch.Tensor, blocks, invariant: bool = False) -> torch.Tensor:
    # LM head through its blocks at any number of rows; a transient dense copy where no kernel takes `hidden`.
    logits = quant_linear(hidden, blocks, None, invariant)
    if logits is None:
        return dense_linear(hidden, gguf_dequantize(blocks[1]).to(hidden), None, None, invariant)
    return logits


def _weight_bytes(model: nn.Module) -> int:
    # Resident weight bytes: parameters, oneDNN-packed copies and block copies.
    seen, total = set(), 0

    def add(t) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor):
            return
        if t.is_mkldnn:  # oneDNN's packed layout has no storage to inspect; about its logical size
            key, nbytes = id(t), t.numel() * t.element_size()
        else:
            key, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        if key not in seen:
            seen.add(key)
            total += nbytes

    for p in model.parameters():
        add(p)
    for m in model.modules():
        for blocks in (getattr(m, "exact_blocks", None), getattr(m, "blocks", None),
                       getattr(m, "_lm_head_blocks", None)):
            if blocks is not None:
                for t in blocks[1].parts:
                    add(t)
        add(getattr(m, "packed_weight", None))
        add(getattr(m, "_lm_head_packed", None))
    return total
