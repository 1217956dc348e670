"""Weights held as the raw blocks of their GGUF file (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS).

The loader copies each quantized tensor's bytes out of the file as they are ([rows, row_bytes] uint8, the
blocks of a row running along the input dim) and never builds its float32 form; the kernels rebuild
blocks in registers (kernels/csrc/gguf_gemm.cpp). A fused projection (qkv_proj, gate_up_proj) is the row
concatenation of its parts, which may come in different types (a Q4_K_M file stores some attn_v and
ffn_down tensors as Q6_K), so a weight is a list of row segments, one type each:

    GGUFWeight(qtypes=(12, 14), parts=(q|k rows as Q4_K, v rows as Q6_K), in_features=576)

A weight whose blocks run along its inputs in another order (act-order GPTQ: model/hf_quant.py) carries that
order, and x's columns are gathered into it before the multiply.

Every batch size goes through the blocks: a few rows of x through the block GEMM gemm_gguf (bound by
reading the weights; every type runs a hand-vectorized kernel, csrc/gguf_decode.h, in every build but
baseline), many rows as tiles of at most TILE_BYTES of float32 weights dequantized into a scratch buffer and
multiplied by torch's GEMM (bound by arithmetic), so no whole float32 weight ever exists.

bfloat16 activations (--dtype bfloat16, what `auto` picks on CPUs with AMX) give bfloat16 outputs; gemm_gguf
widens them to float32 once per call. On the `amx` kernel variant, Q4_1 and Q8_0 weights multiply more than
DECODE_MAX_ROWS_AMX rows through gemm_gguf_amx (csrc/gguf_amx.cpp: blocks rebuilt into bf16 AMX tiles, and
from 512 rows the weight rebuilt as bf16 for torch's bf16 GEMM, oneDNN on AMX).

Where the kernel variant has it (avx2, avx512, amx), weights whose every type is in INT8_TYPES (Q4_K, Q5_K, Q6_K)
take gemm_gguf_int8 from INT8_MIN_ROWS rows of x on (batched decode and prefill alike; bf16 x on the amx
variant up to INT8_MAX_ROWS_AMX) instead of gemm_gguf or dequantized tiles: x quantized to int8 per 256 values
and integer dot products (csrc/gguf_int8.h; from 32 rows register-tiled with each weight rebuilt once per call,
csrc/gguf_int8_tiles.h), as llama.cpp does; results differ from the float kernels by x's rounding (at most
sum |w| * dx / 2 per output). Where the variant also has the few-row int8 kernel for every type of the weight
(csrc/gguf_int8_gemv.h, gguf_int8_gemv_types(): the k-quants on avx2, avx512, amx), int8 starts at 1 row
(single-stream decode).
Q5_0 / Q5_1 weights take it for INT8_Q5_ROWS rows on avx512 / amx, IQ4_XS from 1 row, Q8_0 for INT8_BLOCK32_ROWS
(avx512 / amx on CPUs with VNNI: csrc/gguf_int8_gemv.h at 1-4 rows) and on avx2 Q4_1 and Q8_0 for
INT8_BLOCK32_ROWS; a weight of several types takes it for the rows where all of them do. PAGEDSERVE_GGUF_INT8=0
keeps the float kernels.

From BF16_MIN_ROWS rows of x (prefill; BF16_MIN_ROWS_AMX on CPUs with AMX), weights whose every type is in
BF16_TYPES take gemm_gguf_bf16 instead where the CPU has bf16 dot products (AVX512-BF16 or AMX: gguf_bf16_types()
is empty elsewhere, and AVX2-only CPUs keep the int8 tiles): panels of weight rows rebuilt as bf16 once per call,
each multiplied by all rows of x (rounded to bf16) with oneDNN's brgemm micro-kernel, float32 sums
(csrc/gguf_bf16.cpp). It follows PAGEDSERVE_GGUF_INT8 (off with it: float32 activations stay exact) and
PAGEDSERVE_GGUF_BF16=0 turns it off alone. Q4_1 and Q8_0 weights (BF16_BLOCK32_TYPES) take it too for bf16 x from
BF16_BLOCK32_MIN_ROWS rows, where the variant has no gemm_gguf_amx.

Batch-invariant mode (--batch-invariant, docs/batch_invariance.md): the kernel changing with the number of rows
is what makes a request's greedy tokens depend on the batch (each kernel rounds differently), so there one kernel
serves every row count: gemm_gguf_int8 with batch_invariant=True (gguf_int8.h's driver at every row count) where the
default would take int8 for some row counts, else gemm_gguf (never gemm_gguf_bf16). Both give each row of x the
same sums in the same order
whatever the rows beside it (every block's products into one accumulator per row, in block order; int8 quantizes x
per row), which tests/model/test_batch_invariant.py checks for every type. gemm_gguf_amx and the tiles (torch's
GEMM, whose blocking follows the shape) are not used.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from pagedserve import envs, kernels
from pagedserve.kernels import isa

# GGML type id -> (name, weights per block, bytes per block): the types the kernels rebuild.
GGUF_BLOCK_TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
                    8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
                    23: ("IQ4_XS", 256, 136)}
# Float32 weights one dequantized tile may hold: small next to the model, big enough that torch's GEMM
# runs at full speed (whole layers of a small model are one tile; the LM head is cut into a few).
TILE_BYTES = 8 << 20
# The types gemm_gguf_amx multiplies (at any number of rows above the decode kernel's).
AMX_TYPES = (3, 8)
# The rows of x up to which gemm_gguf's vectorized decode kernel (every type, every build but baseline) beats,
# for bf16 x, gemm_gguf_amx and, for float32 x, dequantized float32 tiles + torch's GEMM (measured on the
# embedded model's shapes, weights cold: benchmarks/HISTORY.md, "Decode block GEMM", benchmarks/gguf_gemv.py).
DECODE_MAX_ROWS_AMX = 4
DECODE_MAX_ROWS = 64
# The baseline build's portable loop (no vectorized decode kernel) wins up to this many rows of x.
PORTABLE_MAX_ROWS = 8
# The types gemm_gguf_int8 takes from INT8_MIN_ROWS rows of x on, where the kernel variant has it.
# Weights cold, 2 threads, Llama-1B shapes, 2-core EPYC Zen 4 at load ~3 (benchmarks/gguf_gemv.py --model
# llama1b, columns gemv f32 / int8 f32): up to 4 rows gemm_gguf reads the weights faster (down_proj Q4_K at 1
# row 498 vs 869 us: its prefetching is tuned, the int8 kernel's is not yet); from 6 rows int8 wins on every
# shape (down_proj Q4_K 1404 vs 1023 us at 6 rows, 2863 vs 1722 at 16, 14546 vs 6704 at 64; Q6_K 1881 vs
# 1082, 5705 vs 1737, 23614 vs 6754). Weights in cache (compute-bound), int8 is 1.1-3.3x faster at every row
# count, on avx2 too (1.2-3.0x). The kernel also multiplies Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (blocks of 32, a
# float scale each), slower than gemm_gguf's table kernels below ~8 rows (Q4_1 at 1 row: 0.5x) and not
# clearly faster above when timed under load: not chosen until timed quietly. Prefill (64-2048 rows, Llama-1B
# shapes, bf16 x, EPYC Zen 4): int8 beats the dequantized bf16 tiles at every row count (benchmarks/gguf_gemv.py
# --model llama1b --prefill; benchmarks/README.md), so there is no upper bound, except for bf16 x on the amx
# variant, whose tiles run torch's bf16 GEMM on AMX: int8 was timed there up to INT8_MAX_ROWS_AMX rows only.
INT8_TYPES = (12, 13, 14)
INT8_MIN_ROWS = 5
INT8_MAX_ROWS_AMX = 64
# With the few-row kernel (csrc/gguf_int8_gemv.h), int8 from 1 row: at 1 row of x, weights cold, 1 thread,
# Llama-1B shapes, it reads 1.6-2.5x the GB/s of gemm_gguf on AVX-512 CPUs (benchmarks/README.md), 2.5-3.4x on an
# AVX2-only EPYC (Zen 3; benchmarks/gguf_gemv.py --model llama1b --rows 1: Q4_K 9-10 vs 2.7-3.6 GB/s).
INT8_GEMV_MIN_ROWS = 1
# Q5_0 and Q5_1 (blocks of 32) take gemm_gguf_int8 for INT8_Q5_ROWS on the avx512 / amx variants: gemm_gguf has
# no table kernel for them beyond 4 rows. SmolLM2-135M shapes, weights cold, 1 thread, thread CPU time, 2-core
# EPYC at load ~13: int8 1.4-1.8x faster at 8 rows, 1.7-3.0x at 16-32, 1.9-3.6x at 64, 0.5-0.9x below 8. Q4_0,
# Q4_1 and Q8_0 stay on the float kernels (0.4-0.9x up to 8 rows, 0.9-1.8x above, mixed by shape).
INT8_Q5_TYPES = (6, 7)
INT8_Q5_ROWS = (8, 64)
# IQ4_XS (kIq4Values looked up by vpshufb, offset by 128: VNNI only, so avx512 / amx on CPUs with avx512_vnni)
# takes gemm_gguf_int8 from 1 row on (from INT8_IQ4_MIN_ROWS without the few-row kernel): 1-4 rows through
# csrc/gguf_int8_gemv.h, 5-31 gguf_int8.h's driver, 32+ the register tiles (csrc/gguf_int8_tiles.h), no upper
# bound (as the k-quants). Llama-1B shapes, weights cold, 1 thread, CPU time per call, 2-core EPYC at load 12-13
# (the process got a quarter of a core: ratios only; benchmarks/gguf_gemv.py --model llama1b --types IQ4_XS):
# int8 over gemm_gguf 1.2-2.4x at 1-4 rows, 0.8-1.4x at 5-7, 1.2-1.4x at 8; over dequantized bf16 tiles
# (--prefill) 1.5-4.3x at 256 rows, 1.1-2.3x at 512, 0.87x (q/o_proj) to 2.1x at 1024.
INT8_IQ4_TYPES = (23,)
INT8_IQ4_MIN_ROWS = 8
# Q8_0 at 1-2 rows through the same few-row kernel (gguf_int8_gemv.h: llama.cpp's q8_0 x q8_0 dot; avx512 /
# amx on CPUs with VNNI): same measurements, int8 over gemm_gguf at 1 row 0.8-1.5x (median 1.15, 5 shapes x
# 2 runs), 2 rows median 1.06, 4 rows median 0.98 (down_proj 0.5: its 8,192 inputs take 2 rows per pass); more
# rows keep the float kernels (gguf_int8.h's driver mixed there). On avx2 the few-row kernel has Q4_1 and Q8_0
# (no VNNI: vpmaddubsw with Q8_0's signs moved onto x), the embedded SmolLM2's types: 1 row at 0.62-0.86x
# gemm_gguf's time, 2 rows 0.68-0.76x (2-core AVX2 EPYC, weights cold, 1 and 2 threads: its Q8_0 LM head
# 49152 x 576 and gate_up_proj 3072 x 576 Q4_1), 4 rows even (benchmarks/gguf_gemv.py --model smollm).
INT8_BLOCK32_TYPES = (3, 8)
INT8_BLOCK32_ROWS = (1, 2)
# The types gemm_gguf_bf16 takes from BF16_MIN_ROWS rows of x on, where gguf_bf16_types() has them. Llama-1B
# shapes, Q4_K and Q6_K, 1 thread, CPU time per call, 2-core EPYC Zen 4 at load 11-17 (benchmarks/README.md,
# results/gguf_gemv_prefill_bf16_t1.json): over the int8 tiles 0.7-1.1x at 128 rows, 0.99-1.35x at 512 (down_proj
# Q6_K 0.99x), 0.96-1.2x at 1024; so from 256 until a quiet re-time places the crossover. On CPUs with AMX
# (oneDNN's brgemm runs on its tiles there, whatever the kernel variant) from BF16_MIN_ROWS_AMX: Llama-1B shapes,
# Q4_K and Q6_K, 1 thread, CPU time per call, 2-core Xeon (Sapphire Rapids class) at load 5-14: over int8 (the
# driver below 32 rows, the tiles from 32) 1.05-1.5x at 24 rows, 1.05-1.6x at 32, 1.4-1.9x at 48-64, 2.5-2.8x at
# 512, 2.2-2.9x at 2,048; at 16 rows mixed (0.8-1.2x: int8 keeps it). Before, 65-255 rows of bf16 x took the
# dequantized tiles there (past INT8_MAX_ROWS_AMX), 3-9x slower than the panels.
BF16_TYPES = (12, 13, 14)
BF16_MIN_ROWS = 256
BF16_MIN_ROWS_AMX = 24
# Blocks of 32 (Q4_1, Q8_0: the embedded SmolLM2's weights and its tied LM head) take gemm_gguf_bf16 for bf16 x
# from BF16_BLOCK32_MIN_ROWS rows, off the amx variant (gemm_gguf_amx has them there). Float32 x keeps the exact
# float kernels. Embedded model, bf16, 1 thread, CPU ms per engine step, in turns with gemm_gguf / the tiles,
# 2-core EPYC Zen 4 at load 14-18 (benchmarks/README.md, issue 28): 5 rows 21-28 vs 34-39 (gemm_gguf wins),
# 9 rows 35-39 vs 41-46, 17 rows 53-88 vs 45-48, 64 rows 158-168 vs 78-85, 112 rows 197-245 vs 103-124, 528
# rows 606-768 vs 434-493, 2,048 rows 1,928-2,304 vs 1,842-1,891.
BF16_BLOCK32_TYPES = (3, 8)
BF16_BLOCK32_MIN_ROWS = 16


@dataclass(slots=True)
class GGUFWeight:
    qtypes: tuple[int, ...]
    parts: tuple[torch.Tensor, ...]  # uint8 [rows_i, row_bytes_i], contiguous
    in_features: int
    # The input columns in the blocks' order (y = x[:, in_order] @ blocks^T), None for the natural order.
    in_order: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return sum(p.shape[0] for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.parts)

    def type_names(self) -> str:
        return "+".join(dict.fromkeys(GGUF_BLOCK_TYPES[t][0] for t in self.qtypes))


def row_bytes(qtype: int, in_features: int) -> int:
    _, elems, nbytes = GGUF_BLOCK_TYPES[qtype]
    if in_features % elems:
        raise ValueError(f"{GGUF_BLOCK_TYPES[qtype][0]} rows hold multiples of {elems} weights, got {in_features}")
    return in_features // elems * nbytes


def concat_rows(weights: list[GGUFWeight]) -> GGUFWeight:
    # Row concatenation (fused projections); neighbouring parts of one type merge into one part.
    if len({w.in_features for w in weights}) != 1:
        raise ValueError("fused GGUF weights must share their input size")
    orders = [w.in_order for w in weights]
    if any(o is not None for o in orders) and not all(o is not None and torch.equal(o, orders[0]) for o in orders):
        raise ValueError("fused GGUF weights must share their input order")
    qtypes: list[int] = []
    parts: list[list[torch.Tensor]] = []
    for w in weights:
        for t, p in zip(w.qtypes, w.parts):
            if qtypes and qtypes[-1] == t:
                parts[-1].append(p)
            else:
                qtypes.append(t)
                parts.append([p])
    return GGUFWeight(tuple(qtypes), tuple(p[0] if len(p) == 1 else torch.cat(p) for p in parts),
                      weights[0].in_features, orders[0])


def _ops():
    ops = kernels.load()
    if ops is None:
        raise RuntimeError("GGUF block weights need the compiled CPU kernels (pagedserve/kernels)")
    return ops


def gguf_dequantize(w: GGUFWeight, rows: slice | None = None) -> torch.Tensor:
    # float32 [rows, in_features]: exactly what gguf.quants.dequantize returns for those rows.
    ops, rows = _ops(), rows or slice(0, w.out_features)
    out, start = [], 0
    for t, p in zip(w.qtypes, w.parts):
        lo, hi = max(rows.start - start, 0), min(rows.stop - start, p.shape[0])
        if lo < hi:
            out.append(ops.dequant_gguf(p[lo:hi], t))
        start += p.shape[0]
    return out[0] if len(out) == 1 else torch.cat(out)


def gguf_embedding(w: GGUFWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # Rows `ids` (any shape) as `dtype` [..., in_features]: gathers only those rows' blocks.
    if len(w.parts) != 1:
        raise ValueError("a GGUF embedding table is one tensor of one type")
    flat = ids.reshape(-1)
    rows = _ops().dequant_gguf(w.parts[0].index_select(0, flat), w.qtypes[0])
    return rows.to(dtype).reshape(*ids.shape, w.in_features)


@functools.cache
def _amx_gemm(ops):
    # gemm_gguf_amx where `ops` is the amx variant, else None (other builds do not register it).
    return getattr(ops, "gemm_gguf_amx", None)


@functools.cache
def _has_decode_kernel(ops) -> bool:
    # The baseline build multiplies every type with the portable loop (csrc/gguf_gemm.cpp).
    return ops.compiled_isa() != "baseline"


@functools.cache
def _int8_types(ops) -> frozenset[int]:
    # The INT8_TYPES gemm_gguf_int8 multiplies in this build on this CPU (none in baseline).
    return frozenset(ops.gguf_int8_types()) & frozenset(INT8_TYPES)


@functools.cache
def _int8_q5_types(ops) -> frozenset[int]:
    # INT8_Q5_TYPES where gemm_gguf_int8 multiplies them and they were timed (avx512, amx variants)
    if ops.compiled_isa() not in ("avx512", "amx"):
        return frozenset()
    return frozenset(ops.gguf_int8_types()) & frozenset(INT8_Q5_TYPES)


@functools.cache
def _int8_iq4_types(ops) -> frozenset[int]:
    # INT8_IQ4_TYPES where gemm_gguf_int8 multiplies them (avx512, amx variants on a CPU with VNNI)
    if ops.compiled_isa() not in ("avx512", "amx"):
        return frozenset()
    return frozenset(ops.gguf_int8_types()) & frozenset(INT8_IQ4_TYPES)


@functools.cache
def _int8_gemv_types(ops) -> frozenset[int]:
    # The types gemm_gguf_int8's few-row kernel multiplies in this build (none before avx512).
    return frozenset(ops.gguf_int8_gemv_types())


@functools.cache
def _bf16_types(ops) -> frozenset[int]:
    # BF16_TYPES gemm_gguf_bf16 multiplies in this build on this CPU (AVX512-BF16 or AMX: none elsewhere)
    return frozenset(ops.gguf_bf16_types()) & frozenset(BF16_TYPES)


@functools.cache
def _bf16_block32_types(ops) -> frozenset[int]:
    # BF16_BLOCK32_TYPES gemm_gguf_bf16 multiplies in this build on this CPU
    return frozenset(ops.gguf_bf16_types()) & frozenset(BF16_BLOCK32_TYPES)


@dataclass(frozen=True, slots=True)
class KernelChoice:
    # How one weight's matmuls run in this process, decided once per (block types, activation dtype, kernel
    # variant, PAGEDSERVE_GGUF_INT8, PAGEDSERVE_GGUF_BF16): from bf16_min_rows rows of x (never when 0) through
    # gemm_gguf_bf16, else int8_min_rows to int8_max_rows rows through gemm_gguf_int8 (none when 0, no bound at
    # sys.maxsize), else up to gemv_max_rows through gemm_gguf, more through gemm_gguf_amx where `amx`, else
    # through dequantized tiles and torch's GEMM.
    gemv_max_rows: int
    amx: bool
    int8_max_rows: int = 0
    int8_min_rows: int = INT8_MIN_ROWS
    bf16_min_rows: int = 0
    # batch-invariant int8 runs gguf_int8.h's driver at every m; without VNNI it has no Q8_0 and its Q4_1 is slower
    # than gemm_gguf (AVX2 EPYC, 3072 x 576: 1.6x at 1 row, 1.1x at 16 and 256), so there blocks of 32 keep gemm_gguf
    int8_invariant: bool = True

    def path(self, m: int, invariant: bool = False) -> str:
        # "bf16", "int8", "gemv", "amx" or "tiles" for m rows of x; batch-invariant: one row-independent kernel
        # at every m
        if invariant:
            return "int8" if self.int8_max_rows and self.int8_invariant else "gemv"
        if 0 < self.bf16_min_rows <= m:
            return "bf16"
        if self.int8_min_rows <= m <= self.int8_max_rows:
            return "int8"
        return "gemv" if m <= self.gemv_max_rows else "amx" if self.amx else "tiles"


# The decoder stack's code per path (csrc/decoder_layers.cpp's gemm_ids); "tiles" has none (the modules run).
GEMM_IDS = {"gemv": 0, "amx": 1, "int8": 2, "bf16": 3}


@functools.cache
def _cpu_has_amx() -> bool:
    return "amx_bf16" in isa.cpu_flags()


def bf16_min_rows() -> int:
    # the rows of x from which gemm_gguf_bf16 beats the int8 tiles on this CPU
    return BF16_MIN_ROWS_AMX if _cpu_has_amx() else BF16_MIN_ROWS


def kernel_choice(ops, dtype: torch.dtype, qtypes: tuple[int, ...]) -> KernelChoice:
    bf16_rows = bf16_min_rows() if envs.gguf_int8() and envs.gguf_bf16() else 0
    return _kernel_choice(ops, dtype, qtypes, envs.gguf_int8(), bf16_rows)


def _int8_rows(ops, dtype: torch.dtype, qtype: int) -> tuple[int, int] | None:
    # The rows of x (lowest, highest) for which one part of this type takes gemm_gguf_int8; None: never.
    high = INT8_MAX_ROWS_AMX if dtype == torch.bfloat16 and ops.compiled_isa() == "amx" else sys.maxsize
    if qtype in _int8_types(ops):
        return INT8_GEMV_MIN_ROWS if qtype in _int8_gemv_types(ops) else INT8_MIN_ROWS, high
    if qtype in _int8_q5_types(ops):
        return INT8_Q5_ROWS
    if qtype in _int8_iq4_types(ops):
        return INT8_GEMV_MIN_ROWS if qtype in _int8_gemv_types(ops) else INT8_IQ4_MIN_ROWS, high
    if qtype in INT8_BLOCK32_TYPES and qtype in _int8_gemv_types(ops):
        return INT8_BLOCK32_ROWS
    return None


@functools.cache
def _kernel_choice(ops, dtype: torch.dtype, qtypes: tuple[int, ...], int8_allowed: bool,
                   bf16_rows: int = 0) -> KernelChoice:
    # bf16_rows: bf16_min_rows() where PAGEDSERVE_GGUF_INT8 and PAGEDSERVE_GGUF_BF16 allow gemm_gguf_bf16, else 0
    amx = dtype == torch.bfloat16 and _amx_gemm(ops) is not None and all(t in AMX_TYPES for t in qtypes)
    bf16 = bf16_rows if all(t in _bf16_types(ops) for t in qtypes) else 0
    if bf16_rows and dtype == torch.bfloat16 and _amx_gemm(ops) is None and all(t in _bf16_block32_types(ops)
                                                                                  for t in qtypes):
        bf16 = BF16_BLOCK32_MIN_ROWS
    int8, low = 0, INT8_MIN_ROWS
    spans = [_int8_rows(ops, dtype, t) for t in qtypes] if int8_allowed else [None]
    if None not in spans and max(lo for lo, _ in spans) <= min(hi for _, hi in spans):
        # every part's type takes int8 for these rows (each part runs its own call: _by_parts)
        low, int8 = max(lo for lo, _ in spans), min(hi for _, hi in spans)
    invariant = bool(ops.gguf_int8_types(True)) or not any(t in INT8_BLOCK32_TYPES for t in qtypes)
    if not _has_decode_kernel(ops):
        return KernelChoice(PORTABLE_MAX_ROWS, amx, int8, low, bf16, invariant)
    return KernelChoice(DECODE_MAX_ROWS_AMX if amx else DECODE_MAX_ROWS, amx, int8, low, bf16, invariant)


def gguf_linear(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None,
                invariant: bool = False) -> torch.Tensor:
    # y = x W^T (+ bias) for float32 or bfloat16 x [M, in_features], any M; y has x's dtype. invariant: each
    # row of y is the same whatever M and the other rows (batch-invariant mode).
    ops, m = _ops(), x.shape[0]
    x = x.contiguous() if w.in_order is None else x.index_select(1, w.in_order)
    path = kernel_choice(ops, x.dtype, w.qtypes).path(m, invariant)
    if path == "bf16":
        return _by_parts(w, bias, lambda p, t, b: ops.gemm_gguf_bf16(x, p, t, b))
    if path == "int8":
        return _by_parts(w, bias, lambda p, t, b: ops.gemm_gguf_int8(x, p, t, b, None, invariant))
    if path == "gemv":
        return _by_parts(w, bias, lambda p, t, b: ops.gemm_gguf(x, p, t, b))
    if path == "amx":
        return _by_parts(w, bias, lambda p, t, b: _amx_gemm(ops)(x, p, t, b))
    tile_rows = max(16, TILE_BYTES // (4 * w.in_features))
    if w.out_features <= tile_rows:
        y = x @ gguf_dequantize(w).to(x.dtype).t()
    else:
        y = torch.empty(x.shape[0], w.out_features, dtype=x.dtype)
        for r0 in range(0, w.out_features, tile_rows):
            r1 = min(r0 + tile_rows, w.out_features)
            y[:, r0:r1] = x @ gguf_dequantize(w, slice(r0, r1)).to(x.dtype).t()
    return y if bias is None else y.add_(bias)


def _by_parts(w: GGUFWeight, bias: torch.Tensor | None, gemm) -> torch.Tensor:
    # gemm(part, type, bias) over the row segments of w, concatenated along the output features.
    if len(w.parts) == 1:
        return gemm(w.parts[0], w.qtypes[0], bias)
    y = torch.cat([gemm(p, t, None) for t, p in zip(w.qtypes, w.parts)], dim=1)
    return y if bias is None else y.add_(bias)
