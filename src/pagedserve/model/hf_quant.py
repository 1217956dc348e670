"""Hugging Face quantized checkpoints (AWQ, GPTQ, FP8) as GGUF blocks, multiplied by the GGUF kernels.

config.json's quantization_config names the method. Each quantized linear's tensors become a GGUFWeight
(layers/gguf_quant.py) at load; norms, embeddings and unquantized linears load as usual. The layouts:

    awq (version gemm, 4 bits, zero points)
        qweight int32 [in, out/8]    nibble i (bits 4i..4i+3) of column c: output 8c + AWQ_ORDER[i]
        qzeros  int32 [in/g, out/8]  the same order;   scales fp16 [in/g, out]
    gptq (4 bits, sym or not, desc_act or not)
        qweight int32 [in/8, out]    nibble i of row r: input 8r + i
        qzeros  int32 [in/g, out/8]  nibble i of column c: output 8c + i;   scales fp16 [in/g, out]
        g_idx   int32 [in]           each input's group (unsorted under desc_act, "act-order")
    both: w[o, i] = (q - z) * s, with q, z, s those of i's group. GPTQ's checkpoint_format "gptq" (AutoGPTQ,
        the default, and what vLLM's GPTQ kernels and transformers' GPTQ backends assume) stores z - 1, so a
        symmetric checkpoint's zeros read 7 and mean 8; "gptq_v2" (GPTQModel) stores z itself.
    compressed-tensors (float-quantized: FP8 e4m3 weights) and fp8 (vLLM's own, block-scaled)
        weight float8_e4m3fn [out, in] times weight_scale (compressed-tensors) or weight_scale_inv (fp8), one
        scale per tensor [1], channel [out, 1], group [out, in/g] or block [out/128, in/128].

Blocks. A 4-bit group is g/32 blocks of 32 weights with the group's (s, z): Q4_0 (w = d (q - 8), d = s) when
every zero of the layer is 8, which is exact; otherwise Q4_1 (w = d q + m, d = s, m = -z s rounded to fp16,
within half an fp16 ulp of 15 s: tests/model/test_hf_quant.py measures it). FP8 weights are dequantized and
each block of 32 requantized to Q8_0 (error within half a step of the block's max / 127). Either way the
weight runs through the same dispatcher as a GGUF file's (gguf_linear, the decoder stack).

Act-order GPTQ: the input columns are put in group order (a stable sort of g_idx) so each block of 32 lies in
one group; the weight keeps that order (GGUFWeight.in_order) and x is gathered into it per call. A fused
projection's parts share the first part's order (q/k/v and gate/up see the same inputs, so GPTQ orders them
alike); a part whose groups do not fall into whole blocks under it leaves the fused layer dense.

Activations stay float: a checkpoint's activation scales (input_scale, FP8 dynamic activations) and KV-cache
scales are not used. `--quantization none` and tensor parallelism dequantize every weight exactly.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from pagedserve.model.gguf_weights import linear_sources, set_blocks
from pagedserve.model.layers.gguf_quant import GGUFWeight, concat_rows
from pagedserve.model.weight_quant import quantize_q8_0

SUPPORTED = ("awq (version gemm, 4 bits, zero points)", "gptq (4 bits, checkpoint_format gptq or gptq_v2)",
             "compressed-tensors (float-quantized FP8 weights)", "fp8")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
BLOCK = 32
Q4_0, Q4_1, Q8_0 = 2, 3, 8
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Activation and KV-cache scales: activations stay float here.
_UNUSED = (".input_scale", ".k_scale", ".v_scale", ".output_scale")


@dataclass(slots=True, frozen=True)
class HFQuantScheme:
    method: str  # quant_method: awq, gptq, compressed-tensors, fp8
    group_size: int = 0  # awq / gptq: inputs per (scale, zero); 0: one group per row
    zero_offset: int = 0  # gptq "gptq" format: z = stored zero + 1


def checkpoint_quantization(hf_config) -> HFQuantScheme | None:
    # None for float checkpoints; ValueError naming the method for quantized ones we cannot load.
    config = getattr(hf_config, "quantization_config", None)
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower()

    def unsupported(what: str) -> ValueError:
        return ValueError(f"quantization_config: {what} is not supported; supported: {'; '.join(SUPPORTED)}")

    if method == "awq":
        version, bits = str(config.get("version", "gemm")).lower(), config.get("bits", 4)
        if bits != 4 or version != "gemm" or not config.get("zero_point", True):
            raise unsupported(f"awq with bits {bits}, version {version}, zero_point {config.get('zero_point')}")
        return HFQuantScheme("awq", _group_size(config))
    if method == "gptq":
        fmt, bits = config.get("checkpoint_format") or "gptq", config.get("bits", 4)
        if bits != 4 or fmt not in ("gptq", "gptq_v2"):
            raise unsupported(f"gptq with bits {bits}, checkpoint_format {fmt}")
        return HFQuantScheme("gptq", _group_size(config), 1 if fmt == "gptq" else 0)
    if method == "compressed-tensors":
        fmt = config.get("format")
        schemes = [g.get("weights") or {} for g in (config.get("config_groups") or {}).values()]
        if fmt not in ("float-quantized", "naive-quantized") or not schemes or any(
                s.get("type") != "float" or s.get("num_bits") != 8 for s in schemes):
            raise unsupported(f"compressed-tensors format {fmt} with weights "
                              f"{[(s.get('type'), s.get('num_bits')) for s in schemes]}")
        return HFQuantScheme("compressed-tensors")
    if method == "fp8":
        return HFQuantScheme("fp8")
    raise unsupported(f"quant_method {method!r}")


def _group_size(config: dict) -> int:
    group_size = int(config.get("group_size", 128))
    if group_size == -1:
        return 0
    if group_size <= 0 or group_size % BLOCK:
        raise ValueError(f"quantization_config: group_size {group_size} is not supported (a multiple of {BLOCK} "
                         "or -1)")
    return group_size


@dataclass(slots=True)
class Int4Groups:
    # One AWQ / GPTQ linear, unpacked: w[o, i] = (codes[o, i] - zeros[o, g]) * scales[o, g], g = group_ids[i].
    codes: torch.Tensor  # uint8 [out, in], 0..15
    zeros: torch.Tensor  # int16 [out, groups]
    scales: torch.Tensor  # float32 [out, groups]
    group_ids: torch.Tensor  # int64 [in]

    def dequantize(self) -> torch.Tensor:
        # Exact in float32: a 5-bit integer times an fp16 scale.
        g = self.group_ids
        return (self.codes.float() - self.zeros[:, g].float()) * self.scales[:, g]


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    # uint8 [rows, cols * 8]: the 8 nibbles of each int32 word, lowest first (the words' little-endian bytes
    # hold them low nibble first). A byte view: shifting int32 words takes 10x as long.
    b = packed.contiguous().view(torch.uint8)
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(packed.shape[0], -1)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    # [rows, cols * 8]: AWQ's nibble i of column c is output 8c + AWQ_ORDER[i].
    nibbles = _nibbles(packed).reshape(packed.shape[0], -1, 8)
    return nibbles[..., torch.argsort(torch.tensor(AWQ_ORDER))].reshape(packed.shape[0], -1)


def _unpack(tensors: dict[str, torch.Tensor], prefix: str, scheme: HFQuantScheme) -> Int4Groups | torch.Tensor:
    # Pops one linear's tensors: Int4Groups (awq, gptq) or the exact float32 weight (FP8).
    def pop(suffix: str) -> torch.Tensor:
        if f"{prefix}.{suffix}" not in tensors:
            raise ValueError(f"{scheme.method} checkpoint: {prefix}.{suffix} is missing")
        return tensors.pop(f"{prefix}.{suffix}")

    if scheme.method == "awq":
        codes, zeros, scales = _awq_columns(pop("qweight")).t(), _awq_columns(pop("qzeros")).t(), pop("scales").t()
        group_ids = None
    elif scheme.method == "gptq":
        codes, zeros, scales = _nibbles(pop("qweight").t()), _nibbles(pop("qzeros")).t(), pop("scales").t()
        zeros = zeros.to(torch.int16) + scheme.zero_offset
        group_ids = tensors.pop(f"{prefix}.g_idx", None)
    else:
        weight = pop("weight").float()
        scale = pop("weight_scale_inv" if f"{prefix}.weight_scale_inv" in tensors else "weight_scale").float()
        return weight * _expand(scale, *weight.shape)
    num_in = codes.shape[1]
    if group_ids is None:
        group_ids = torch.arange(num_in) // (scheme.group_size or num_in)
    return Int4Groups(codes.contiguous(), zeros.to(torch.int16), scales.float().contiguous(), group_ids.long())


def _expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    # A [R, C] grid of scales (tensor [1], channel [rows, 1], block, group) stretched over [rows, cols].
    scale = scale.reshape(scale.shape[0] if scale.dim() else 1, -1)
    r, c = scale.shape
    return scale.repeat_interleave(-(-rows // r), 0)[:rows].repeat_interleave(-(-cols // c), 1)[:, :cols]


def int4_blocks(parts: list[Int4Groups]) -> GGUFWeight | None:
    # The row concatenation of `parts` as Q4_0 / Q4_1 blocks, or None where some part's groups do not fall
    # into whole blocks of 32 in the shared input order.
    first = parts[0].group_ids
    order = None if bool((first[1:] >= first[:-1]).all()) else torch.argsort(first, stable=True)
    symmetric = all(bool((p.zeros == 8).all()) for p in parts)
    weights = []
    for p in parts:
        ids = p.group_ids if order is None else p.group_ids[order]
        if ids.numel() % BLOCK:
            return None
        ids = ids.view(-1, BLOCK)
        if not bool((ids == ids[:, :1]).all()):
            return None
        group = ids[:, 0]
        codes = p.codes if order is None else p.codes[:, order]
        raw = _q4_bytes(codes, p.zeros[:, group], p.scales[:, group], symmetric)
        weights.append(GGUFWeight((Q4_0 if symmetric else Q4_1,), (raw,), codes.shape[1], order))
    return concat_rows(weights)


def _q4_bytes(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, symmetric: bool) -> torch.Tensor:
    # uint8 [rows, blocks * 18 or 20]: GGUF Q4_0 (d, 16 bytes) or Q4_1 (d, m, 16 bytes) blocks, where byte j
    # holds weight j in its low nibble and weight j + 16 in its high one.
    rows, num_blocks = zeros.shape
    q = codes.reshape(rows, num_blocks, 2, 16)
    qs = q[:, :, 0] | (q[:, :, 1] << 4)
    d = scales.half()
    halves = [d] if symmetric else [d, (-zeros.float() * d.float()).half()]  # Q4_1: d q + m = d (q - z)
    fields = [h.unsqueeze(-1).view(torch.uint8) for h in halves] + [qs]
    return torch.cat(fields, dim=-1).reshape(rows, -1).contiguous()


def q8_blocks(weight: torch.Tensor) -> GGUFWeight | None:
    # A float32 weight requantized to Q8_0, None where rows are not whole blocks.
    return None if weight.shape[1] % BLOCK else quantize_q8_0(weight)


def _blocks(parts: list) -> GGUFWeight | None:
    if isinstance(parts[0], Int4Groups):
        return int4_blocks(parts)
    weights = [q8_blocks(p) for p in parts]
    return None if None in weights else concat_rows(weights)


def _dense(unpacked: Int4Groups | torch.Tensor) -> torch.Tensor:
    return unpacked.dequantize() if isinstance(unpacked, Int4Groups) else unpacked


def _read(weights: Iterable[tuple[str, torch.Tensor]], scheme: HFQuantScheme) -> tuple[dict, list[str]]:
    # (the checkpoint's tensors, the names of its quantized linears). Linears are unpacked one at a time
    # later: their unpacked codes take twice the packed bytes.
    tensors = {name: t for name, t in weights if not name.endswith(_UNUSED)}
    if scheme.method in ("awq", "gptq"):
        return tensors, [n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")]
    return tensors, [n.removesuffix(".weight") for n, t in tensors.items()
                     if n.endswith(".weight") and t.dtype in FP8_DTYPES]


def _dequantized(tensors: dict, names: list[str], scheme: HFQuantScheme) -> Iterator[tuple[str, torch.Tensor]]:
    # The quantized linears `names` dequantized (one float32 copy at a time), then the plain tensors left.
    for name in names:
        yield f"{name}.weight", _dense(_unpack(tensors, name, scheme))
    yield from tensors.items()


def dequantized_checkpoint(weights: Iterable[tuple[str, torch.Tensor]],
                           scheme: HFQuantScheme) -> Iterator[tuple[str, torch.Tensor]]:
    # The checkpoint as float tensors under the model's names (--quantization none, tensor parallelism).
    return _dequantized(*_read(weights, scheme), scheme)


def load_quantized_checkpoint(model, weights: Iterable[tuple[str, torch.Tensor]], scheme: HFQuantScheme) -> None:
    # Quantized linears as GGUF blocks where every part of a (fused) linear converts, the rest dense.
    tensors, names = _read(weights, scheme)
    left, dense = set(names), []
    for m, sources in linear_sources(model):
        if not all(s in left for s in sources):
            continue
        left.difference_update(sources)
        parts = [_unpack(tensors, s, scheme) for s in sources]
        blocks = _blocks(parts)
        if blocks is not None and (blocks.out_features, blocks.in_features) != (m.out_features, m.in_features):
            raise ValueError(f"{scheme.method} checkpoint: {sources} hold a [{blocks.out_features}, "
                             f"{blocks.in_features}] weight, the config says [{m.out_features}, {m.in_features}]")
        if blocks is not None:
            set_blocks(m, blocks)
        else:
            dense.extend((f"{s}.weight", _dense(p)) for s, p in zip(sources, parts))
    model.load_weights(itertools.chain(dense, _dequantized(tensors, [n for n in names if n in left], scheme)))
