"""`--quantization`: weights that stay quantized in memory, one resident copy each.

    gguf  (the default for GGUF files) every Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / IQ4_XS tensor is
          copied from the file as its raw blocks, its only resident copy (model/gguf_weights.py); no fp32 form
          is built. A few rows multiply through the block GEMM (up to 4-64 by type, dtype and kernel
          variant); larger batches dequantize tiles of at most 8 MB into a scratch buffer for torch's GEMM
          or multiply through the AMX kernel (layers/gguf_quant.py). The
          embedding gathers and dequantizes only the rows it reads; a tied LM head multiplies by the same
          blocks. Tensors of other GGUF types (F16, BF16, Q2_K, ...) stay fp32.
    int8  weight-only int8 for float32 / bfloat16 Hugging Face checkpoints: each weight is quantized at load
          into Q8_0 blocks (int8 codes with one float32 scale per 32 inputs, finer than per channel) and runs
          through the same kernels.
    none  dequantized fp32 (or --dtype) weights, as loaded.

gguf runs with --dtype float32 or bfloat16 (so `auto` keeps the file's blocks on CPUs with AMX, multiplied
in bf16 by the AMX kernel; layers/gguf_quant.py), int8 with float32 only; both need the compiled kernels.
Asking for them otherwise is a start-up error naming the flag. Leaving --quantization unset never fails: it
falls back to none where blocks cannot run.
"""
from __future__ import annotations

import gc
import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import kernels
from pagedserve.config import QUANTIZATIONS
from pagedserve.malloc import release_free_memory
from pagedserve.model.layers.gguf_quant import GGUFWeight, gguf_embedding
from pagedserve.model.layers.linear import Linear
from pagedserve.model.layers.quant import BLOCK, dequantize_blocks, quantize_q8_0

logger = logging.getLogger(__name__)


def resolve_quantization(requested: str | None, is_gguf: bool, dtype: torch.dtype, device: torch.device) -> str:
    on_cpu = device.type == "cpu" and kernels.load() is not None
    runnable = {"gguf": on_cpu and dtype in (torch.float32, torch.bfloat16), "int8": on_cpu and dtype == torch.float32}
    method = "gguf" if is_gguf else "int8"
    if requested is None:
        return "gguf" if is_gguf and runnable["gguf"] else "none"
    if requested not in QUANTIZATIONS:
        raise ValueError(f"--quantization {requested!r} is not supported; valid values: {', '.join(QUANTIZATIONS)}")
    valid = ", ".join([method, "none"] if runnable[method] else ["none"])
    if requested == "gguf" and not is_gguf:
        raise ValueError(f"--quantization gguf needs a GGUF file; for this model use one of: {valid}")
    if requested == "int8" and is_gguf:
        raise ValueError(f"--quantization int8 quantizes float Hugging Face checkpoints, not a GGUF file; for this "
                         f"model use one of: {valid}")
    if requested != "none" and not runnable[requested]:
        dtypes = "float32 or bfloat16" if requested == "gguf" else "float32"
        raise ValueError(f"--quantization {requested} needs --dtype {dtypes} on CPU with the compiled kernels "
                         f"(here: {str(dtype).removeprefix('torch.')} on {device.type}, kernels "
                         f"{'on' if kernels.load() is not None else 'unavailable'}); valid values here: {valid}")
    return requested


class BlockEmbedding(nn.Module):
    # An embedding table held only as blocks: a lookup dequantizes the rows it reads.
    def __init__(self, blocks, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.blocks = blocks
        self.dtype = dtype  # the model's activations
        self.weight = None  # no dense table; compute_logits multiplies through the blocks

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.blocks[0] == "gguf":
            return gguf_embedding(self.blocks[1], input_ids, self.dtype)
        fmt, (qs, scales) = self.blocks
        return dequantize_blocks((fmt, (qs[input_ids], scales[input_ids])))


def apply_quantization(model: nn.Module, method: str) -> None:
    # After load_weights (pack_weights has found the exact blocks). Frees the dense copies of quantized weights.
    if method == "none":
        return
    dense_before = _weight_bytes(model)
    num_quantized, num_linear = 0, 0
    for m in model.modules():
        if not isinstance(m, Linear):
            continue
        num_linear += 1
        if method == "int8" and m.weight is not None and m.weight.shape[1] % BLOCK == 0:
            m.exact_blocks = ("q8_0", quantize_q8_0(m.weight))
        if m.exact_blocks is not None:
            m.weight, m.packed_weight = None, None
            num_quantized += 1
    embed = model.model.embed_tokens
    if method == "int8" and model.lm_head is None and embed.weight is not None and embed.weight.shape[1] % BLOCK == 0:
        model._lm_head_blocks = ("q8_0", quantize_q8_0(embed.weight))
    if isinstance(embed, BlockEmbedding):
        pass  # loaded as blocks (model/gguf_weights.py)
    elif model.lm_head is None and model._lm_head_blocks is not None:  # tied: one block table serves both
        model.model.embed_tokens = BlockEmbedding(model._lm_head_blocks)
        model._lm_head_packed = None
    elif model.lm_head is not None:
        model._lm_head_packed, model._lm_head_blocks = model.lm_head.packed_weight, model.lm_head.exact_blocks
    gc.collect()
    release_free_memory()
    logger.info("quantization %s: %d of %d linear weights kept only as blocks%s; weights %.0f MB (before: %.0f MB)",
                method, num_quantized, num_linear,
                ", embedding too" if isinstance(model.model.embed_tokens, BlockEmbedding) else "",
                _weight_bytes(model) / 1e6, dense_before / 1e6)


def block_logits(hidden: torch.Tensor, blocks) -> torch.Tensor:
    # LM head through its blocks at any number of rows (the kernel walks rows in passes of 8).
    ops = kernels.ops_for(hidden)
    fmt, (qs, scales) = blocks
    if ops is None or hidden.dim() != 2:
        return F.linear(hidden, dequantize_blocks(blocks))
    return (ops.gemm_q4_1 if fmt == "q4_1" else ops.gemm_q8_0)(hidden.contiguous(), qs, scales, None)


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
                for t in blocks[1].parts if isinstance(blocks[1], GGUFWeight) else blocks[1]:
                    add(t)
        add(getattr(m, "packed_weight", None))
        add(getattr(m, "_lm_head_packed", None))
    return total
