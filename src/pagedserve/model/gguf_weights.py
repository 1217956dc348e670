"""GGUF tensors -> our Llama module tree: names, llama.cpp's q/k row order, and the block load.

`load_gguf_blocks` (--quantization gguf) reads each quantized tensor's bytes from the file (gguf_file.py)
as they are into the layer that multiplies by them (layers/gguf_quant.py); only norms, biases and tensors
of types without a kernel (F16, BF16, Q2_K, ...) become dense tensors of the model's dtype. The float form
of a block weight never exists, so load-time peak memory is the blocks plus one tensor in flight; nothing
maps the file (a weight is never a view of it: it may be replaced under a running server).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from pagedserve.kv_spec import num_kv_heads_of
from pagedserve.model.gguf_config import FAMILY_ARCHITECTURES
from pagedserve.model.gguf_file import GGUFFile
from pagedserve.model.layers.gguf_quant import GGUF_BLOCK_TYPES, GGUFWeight, concat_rows, gguf_dequantize, row_bytes
from pagedserve.model.layers.linear import Linear

logger = logging.getLogger(__name__)

# llama.cpp architecture names we can serve; Mistral GGUFs use "llama". For gemma2, gemma3 and phi3 the
# config is completed from llama.cpp's keys (model/gguf_config.py).
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", *FAMILY_ARCHITECTURES)
# Gemma's norm weights hold 1 + w in a GGUF file (llama.cpp's converter adds the 1), as our layers keep them.
NORMS_HOLD_OFFSET = ("gemma2", "gemma3")
# GGUF per-layer tensor name -> HF name inside model.layers.N
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Where a family's layer differs: Gemma's four norms around the branches; Phi-3's fused [q | k | v] and
# [gate | up] (llama.cpp keeps both fused: attn_qkv, and ffn_up of 2 x intermediate rows).
_ARCH_LAYER_NAMES = {
    "gemma": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_ARCH_LAYER_NAMES["gemma2"] = _ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES.pop("gemma")
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# Precomputed llama3 rope frequencies, Phi-3's longrope factors: our rotary takes them from the config.
SKIPPED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Our fused linears and the HF tensors whose rows they stack, in order (model/llama.py).
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
# Byte offsets of the float16 scales (d, and m / dmin) in each block of the block types (gguf-py's layouts).
_SCALE_OFFSETS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,), 23: (0,)}


def check_finite_scales(name: str, qtype: int, rows: np.ndarray, block_bytes: int, path: str) -> None:
    # A NaN or inf scale makes every output it touches NaN: the server would answer empty completions.
    # float16 is inf or NaN when its five exponent bits are all set: bits 2-6 of its high (second) byte.
    blocks = rows.reshape(rows.shape[0], -1, block_bytes)
    for offset in _SCALE_OFFSETS[qtype]:
        if ((blocks[:, :, offset + 1] & 0x7C) == 0x7C).any():
            raise ValueError(f"GGUF tensor {name} in {path} has non-finite (NaN or inf) scales")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    layer_names = _ARCH_LAYER_NAMES.get(arch, {})
    module = layer_names.get(parts[2], _LAYER_NAMES.get(parts[2])) if len(parts) == 4 else None
    if parts[0] == "blk" and module is not None:
        return f"model.layers.{parts[1]}.{module}.{parts[3]}"
    return None


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp's converter reorders each head's rows from HF's rotate-half layout [x0..x(d/2-1) | y0..]
    # to interleaved pairs [x0 y0 x1 y1 ...] (its rope is GPT-J style). Undo that per head:
    #   gguf rows of a head, viewed [d/2, 2] -> transpose -> [2, d/2] -> HF rows.
    # Only rows move, so this works on float rows and on rows of raw blocks alike.
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def _qk_heads(arch: str, name: str, hf_config) -> int | None:
    # llama.cpp permutes q/k rows (weights and, when present, biases) for its "llama" arch only.
    if arch != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
        return None
    num_heads = hf_config.num_attention_heads
    return num_heads if "q_proj" in name else num_kv_heads_of(hf_config)


def dense_tensors(tensors, arch: str, hf_config, path: str):
    # (HF name, float32 tensor) for (GGUF name, GGMLQuantizationType, numpy data) triples, dequantized with
    # gguf-py: the `none` path's conversion, and the block path's norms and types without a kernel. The data
    # is what GGUFReader gives, or rows of raw bytes [..., row_bytes].
    from gguf.quants import dequantize

    for gguf_name, qtype, data in tensors:
        if gguf_name in SKIPPED:
            continue
        name = _checked_name(gguf_name, arch, path)
        try:
            weight = torch.from_numpy(dequantize(data, qtype).astype("float32"))  # owned copy
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"cannot dequantize {gguf_name} ({qtype.name}) in {path}: {e}") from e
        if not torch.isfinite(weight).all():
            raise ValueError(f"GGUF tensor {gguf_name} in {path} has non-finite (NaN or inf) values")
        heads = _qk_heads(arch, name, hf_config)
        yield name, (weight if heads is None else unpermute_qk(weight, heads)).contiguous()


def _checked_name(gguf_name: str, arch: str, path: str) -> str:
    name = hf_name(gguf_name, arch)
    if name is None:
        raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF {path}")
    return name


def linear_sources(model):
    # (Linear, the checkpoint modules whose weight rows it stacks, in order) for each linear of `model`:
    # (qkv_proj, [model.layers.N.self_attn.q_proj, ...k_proj, ...v_proj]), (lm_head, [lm_head]). A file
    # that stores the fused tensor itself (Phi-3) has it under the linear's own name.
    for module_name, m in model.named_modules():
        if isinstance(m, Linear):
            parts = module_name.split(".")
            fused = _FUSED.get(".".join(parts[-2:]))
            yield m, [module_name] if fused is None else [".".join(parts[:-2] + [s]) for s in fused]


def set_blocks(m: Linear, weight: GGUFWeight) -> None:
    m.weight, m.packed_weight = None, None  # the placeholder goes; the blocks are the weight
    m.exact_blocks = ("gguf", weight)


def load_gguf_blocks(model, gguf: GGUFFile, hf_config) -> None:
    """Loads the file's tensors into `model` (a LlamaForCausalLM built with placeholder weights): block
    types as GGUFWeights in the linears and the embedding, everything else through load_weights."""
    from gguf import GGMLQuantizationType

    from pagedserve.model.weight_quant import BlockEmbedding

    path, arch = gguf.path, gguf.fields.get("general.architecture")
    blocks: dict[str, GGUFWeight] = {}
    dense: list[tuple[str, torch.Tensor]] = []
    for t in gguf.tensors:
        if t.name in SKIPPED:
            continue
        name = _checked_name(t.name, arch, path)
        data = gguf.read(t).reshape(*reversed(t.shape[1:]), -1)  # rows of bytes, outermost dim first
        if t.qtype in GGUF_BLOCK_TYPES and name.endswith(".weight") and len(t.shape) == 2:
            if data.shape[1] != row_bytes(t.qtype, t.shape[0]):
                raise ValueError(f"corrupt GGUF file {path}: {t.name} has rows of {data.shape[1]} bytes")
            check_finite_scales(t.name, t.qtype, data, GGUF_BLOCK_TYPES[t.qtype][2], path)
            rows = torch.from_numpy(data)
            heads = _qk_heads(arch, name, hf_config)
            blocks[name] = GGUFWeight((t.qtype,), (rows if heads is None else unpermute_qk(rows, heads).contiguous(),),
                                      t.shape[0])
        else:
            dense.extend(dense_tensors([(t.name, GGMLQuantizationType(t.qtype), data)], arch, hf_config, path))

    module_names = {id(m): name for name, m in model.named_modules()}
    for m, sources in linear_sources(model):
        fused = blocks.pop(f"{module_names[id(m)]}.weight", None) if len(sources) > 1 else None
        if fused is not None:  # rows already [q | k | v] or [gate | up], as the layer stacks them
            set_blocks(m, fused)
            continue
        found = [blocks.pop(f"{s}.weight", None) for s in sources]
        if all(w is not None for w in found):
            set_blocks(m, concat_rows(found))
        else:  # a part without a kernel: the whole fused weight stays float32
            dense.extend((f"{s}.weight", gguf_dequantize(w)) for s, w in zip(sources, found) if w is not None)
    embed = blocks.pop("model.embed_tokens.weight", None)
    if embed is not None:
        model.model.embed_tokens = BlockEmbedding(("gguf", embed), model.model.norm.weight.dtype)
        if model.lm_head is None:  # tied: one block table serves the lookup and the LM head
            model._lm_head_blocks = ("gguf", embed)
    if model.lm_head is None:
        blocks.pop("lm_head.weight", None)  # tied checkpoints sometimes still store a copy
    if blocks:
        raise ValueError(f"GGUF tensors with no matching layer in {path}: {sorted(blocks)[:5]}")
    model.load_weights(dense, norms_hold_offset=arch in NORMS_HOLD_OFFSET)


