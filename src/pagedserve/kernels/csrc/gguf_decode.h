// Hand-vectorized decode GEMM (a few rows of x) over raw GGUF blocks of every type gguf_blocks.h lists, for
// the avx512 / amx variants (16 float lanes) and avx2 (AVX2 + FMA + F16C, 8 lanes); the baseline build
// defines nothing here and gguf_gemm.cpp keeps its portable loop. The blocks are rebuilt in registers by
// gguf_rebuild.h; below, Q4_0 / Q4_1 / Q8_0 on avx512 with up to 4 rows of x take their own table kernel.
//
// Decode reads every weight once per token, so the work per block of 32 weights must cost less than reading
// its 18-34 bytes (about 1 ns per block per core at this machine's ~11 GB/s per thread). The portable loop
// rebuilds a block into a float buffer with a scalar fp16 conversion and multiplies it in a second pass;
// here a block is rebuilt in registers and used at once. With 512-bit vectors only ports 0 and 5 take
// vector work, so the rebuild is shaped to keep port 0 (FMA, conversions, shifts) free:
//   - scales: the first 4 bytes of 16 consecutive blocks in one gather, widened by F16C 16 at a time into
//     small float arrays, so a block's d and m reach the FMAs as broadcast loads (avx2: one F16C
//     instruction per block, as before);
//   - Q4_0 / Q4_1 (avx512): one FMA builds the block's 16 possible weights, d * k + m or d * (k - 8) for
//     k = 0..15, and vpermps looks the 32 nibbles up in that table (port 5; it reads only an index's low 4
//     bits, so the zero-extended bytes index the low nibbles as they are). d * k is exact in float32 (an
//     11-bit mantissa times at most 4 bits), so every weight is bit for bit the float dequant_gguf
//     returns, as it is on avx2, where the quants widen to int32 and float and w = d * q (+ m);
//   - Q8_0: the quants widen with vpmovsx to int32 and float; w = d * q is exact and multiplied into x (at
//     every number of rows of x: a block's sum as d * (x . q) for 1-2 rows saved a multiply but rounded those
//     rows differently, and a row's result must not depend on the rows beside it).
//   So the results differ from dequant_gguf(W) @ x only by the order and grouping of the float32 sums, and each
//   row of x gets the same sums in the same order whatever the number of rows (batch invariance);
//   - every rebuilt weight vector is multiplied into all MR rows of x at once (x stays in L1), into
//     R x MR independent accumulators: R weight rows at a time hide the FMA latency even for one row of x;
//   - a thread's weight rows are read as 4 runs side by side (gemm), each row's blocks prefetched ahead of
//     where the tile reads them (4 KB for up to 4 rows of x).
// bf16 x is widened to float32 once per call by gguf_gemm.cpp, not per weight row.
#pragma once

#include "gguf_rebuild.h"  // defines PAGEDSERVE_GGUF_DECODE where it builds

#if defined(PAGEDSERVE_GGUF_DECODE)

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace pagedserve::gguf::decode {

// Q4_0 / Q4_1 / Q8_0 on avx512 with up to 4 rows of x: the scales-gathering table kernel (rows_table)
template <int64_t T>
constexpr bool kTablePath = T == kQ4_0 || T == kQ4_1 || T == kQ8_0;

struct Args {
  const float* x;  // [m, k] float32, rows at x_stride
  int64_t x_stride, k;
  const uint8_t* w;  // [n, row_bytes]
  int64_t n, row_bytes;
  const float* bias;  // [n] or null
  void* y;            // [m, n] float or c10::BFloat16, contiguous
};

// Prefetch distance: each of a tile's R rows is prefetched some distance ahead of where it is read, within
// the row; past the row's end the same distance lands in the next row, the same row of the next tile (gemm),
// so rows of any length are covered (a sweep over the tile's R * row_bytes as one range, as before, fell behind the
// reads of its later rows once a row passed ~2 KB: Llama-1B's down_proj, 8,192 inputs, read at 0.5-0.8x the
// GB/s of the 2,048-input shapes). The hardware prefetchers alone leave a single thread ~1.4x slower. For up
// to 4 rows of x, 4 KB ahead per row; for more rows x fills L1 (8 rows of 1536 floats: 48 KB) and lines
// fetched early are evicted before use (1.1-1.6x slower), so those prefetch one tile ahead. (kAhead: the
// distance gguf_amx.cpp's rebuild prefetches at.)
constexpr int64_t kAhead = 8192, kAheadPerRow = 4096;

template <int R, int MR>
inline int64_t ahead(const Args& a) {
  return MR <= 4 ? kAheadPerRow : a.row_bytes;
}

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
}

// The `bytes` at `offset` of each of the R rows from `row` (`apart` bytes apart), `distance` ahead (see
// kAheadPerRow): past a row's end it lands in the next row, the same row of the next tile (see gemm).
template <int R>
inline void prefetch_rows(const uint8_t* row, int64_t apart, int64_t offset, int64_t bytes, int64_t distance) {
  for (int i = 0; i < R; ++i) prefetch(row + i * apart + offset + distance, bytes);
}

#if defined(__AVX512F__)
// Scales are read kChunk blocks at a time into float arrays, so a block's d and m reach the vector units as
// broadcast loads (no shuffle-port work per block).
constexpr int64_t kChunk = 16;

// d[j] (and Q4_1's m[j]) of the `count` <= kChunk blocks from b, `stride` bytes apart: consecutive blocks of
// a row by default; gguf_amx.cpp reads the same block of consecutive rows (stride = the row's bytes).
template <int64_t T>
inline void scales(const uint8_t* b, int64_t count, float* d, float* m, int stride = Format<T>::kBytes) {
  // the first 4 bytes of each block (Q4_0 / Q8_0: d and two quant bytes), one gather; then the low and
  // high fp16 of each as 16 floats
  const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(stride));
  const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), static_cast<__mmask16>((1u << count) - 1),
                                                 at, b, 1);
  _mm512_store_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
  if constexpr (T == kQ4_1) _mm512_store_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
}

// acc[r] += block blk (scales d, m) times x rows r (32 floats at x + r * stride), r < MR.
template <int64_t T, int MR>
inline void block(const uint8_t* blk, float d, float m, const float* x, int64_t stride, Vec* acc) {
  if constexpr (T == kQ8_0) {
    const __m128i* q = reinterpret_cast<const __m128i*>(blk + 2);
    const Vec q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    const Vec q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    // w = d * q (exact) at every MR: a row's sums do not depend on how many rows of x share the pass
    const Vec w0 = _mm512_mul_ps(q0, _mm512_set1_ps(d)), w1 = _mm512_mul_ps(q1, _mm512_set1_ps(d));
    for (int r = 0; r < MR; ++r) acc[r] = fma(w1, load(x + r * stride + 16), fma(w0, load(x + r * stride), acc[r]));
  } else {
    // the 16 weights a nibble stands for, d * k + m (Q4_1) or d * (k - 8) (Q4_0), looked up by the nibbles:
    // vpermps reads only an index's low 4 bits, so q's bytes index directly (low nibbles) and after a
    // shift by 4 (high nibbles)
    const Vec k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const Vec table = T == kQ4_1 ? _mm512_fmadd_ps(k, _mm512_set1_ps(d), _mm512_set1_ps(m))
                                 : _mm512_mul_ps(_mm512_sub_ps(k, _mm512_set1_ps(8.f)), _mm512_set1_ps(d));
    // byte j holds q[j] (low nibble) and q[j + 16] (high nibble)
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (T == kQ4_1 ? 4 : 2))));
    const Vec w0 = _mm512_permutexvar_ps(q, table), w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
    for (int r = 0; r < MR; ++r) acc[r] = fma(w1, load(x + r * stride + 16), fma(w0, load(x + r * stride), acc[r]));
  }
}

// acc[i][r] += weight row i (of R, `apart` bytes apart from `row`) . x row r, over all k / 32 blocks.
template <int64_t T, int R, int MR>
inline void rows_table(const Args& a, const uint8_t* row, int64_t apart, const float* x, Vec (&acc)[R][MR]) {
  constexpr int64_t B = Format<T>::kBytes;
  const int64_t nb = a.k / 32;
  const int64_t distance = ahead<R, MR>(a);
  alignas(64) float d[R][kChunk], m[R][kChunk];
  for (int64_t c = 0; c < nb; c += kChunk) {
    const int64_t count = std::min(kChunk, nb - c);
    for (int i = 0; i < R; ++i) scales<T>(row + i * apart + c * B, count, d[i], m[i]);
    for (int64_t j = 0; j < count; ++j) {
      const int64_t b = c + j;
      prefetch_rows<R>(row, apart, b * B, B, distance);
      for (int i = 0; i < R; ++i)
        block<T, MR>(row + i * apart + b * B, d[i][j], T == kQ4_1 ? m[i][j] : 0.f, x + 32 * b, a.x_stride,
                     acc[i]);
    }
  }
}
#endif

// acc[i][r] += weight row i (of R, `apart` bytes apart from `row`) . x row r, over all blocks: each sub-block
// of 32 rebuilt as float vectors (gguf_rebuild.h), then multiplied into the MR rows of x.
template <int64_t T, int R, int MR>
inline void rows_unpacked(const Args& a, const uint8_t* row, int64_t apart, const float* x, Vec (&acc)[R][MR]) {
  constexpr int64_t E = Format<T>::kElems, B = Format<T>::kBytes;
  const int64_t distance = ahead<R, MR>(a);
  for (int64_t b = 0; b < a.k / E; ++b) {
    prefetch_rows<R>(row, apart, b * B, B, distance);
    for (int i = 0; i < R; ++i) {
      const Rebuild<T> blk(row + i * apart + b * B);
#pragma GCC unroll 8
      for (int j = 0; j < E / 32; ++j) {
        Vec w[kVecs];
        blk.sub(j, w);
        const float* xj = x + E * b + 32 * j;
        for (int r = 0; r < MR; ++r)
          for (int v = 0; v < kVecs; ++v) acc[i][r] = fma(w[v], load(xj + r * a.x_stride + kLanes * v), acc[i][r]);
      }
    }
  }
}

template <int R, int MR, typename Out>
inline void store(const Args& a, int64_t n0, int64_t step, int64_t m0, Vec (&acc)[R][MR]) {
  for (int r = 0; r < MR; ++r) {
    Out* y = static_cast<Out*>(a.y) + (m0 + r) * a.n + n0;
    for (int i = 0; i < R; ++i)
      y[i * step] = static_cast<Out>(hsum(acc[i][r]) + (a.bias ? a.bias[n0 + i * step] : 0.f));
  }
}

// R weight rows n0, n0 + step, ... times MR rows of x from m0.
template <int64_t T, int R, int MR, typename Out>
void tile(const Args& a, int64_t n0, int64_t step, int64_t m0) {
  Vec acc[R][MR];
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < MR; ++r) acc[i][r] = zero();
  const uint8_t* row = a.w + n0 * a.row_bytes;
  const float* x = a.x + m0 * a.x_stride;
#if defined(__AVX512F__)
  // up to 4 rows of x; with more, the table path measured 1.1-1.5x slower than the per-block rebuild (its
  // scale arrays and chunk counters push the x row offsets out of the general registers)
  if constexpr (MR <= 4 && kTablePath<T>) {
    rows_table<T, R, MR>(a, row, step * a.row_bytes, x, acc);
    return store<R, MR, Out>(a, n0, step, m0, acc);
  }
#endif
  rows_unpacked<T, R, MR>(a, row, step * a.row_bytes, x, acc);
  store<R, MR, Out>(a, n0, step, m0, acc);
}

// A group: kGroup weight rows n0, n0 + step, ... (count of them) against all m rows of x, in passes of MR rows
// of x, R weight rows per tile.
constexpr int kGroup = 4;

template <int64_t T, int MR, typename Out>
void group_pass(const Args& a, int64_t n0, int64_t count, int64_t step, int64_t m0) {
  constexpr int R = kAccumulators / MR >= kGroup ? kGroup : (kAccumulators / MR >= 1 ? kAccumulators / MR : 1);
  int64_t i = 0;
  for (; i + R <= count; i += R) tile<T, R, MR, Out>(a, n0 + i * step, step, m0);
  for (; i < count; ++i) tile<T, 1, MR, Out>(a, n0 + i * step, step, m0);
}

template <int64_t T, typename Out>
void group(const Args& a, int64_t m, int64_t n0, int64_t count, int64_t step) {
  constexpr int kMaxRows = kAccumulators >= 16 ? 8 : 4;
  int64_t m0 = 0;
  for (; m0 + kMaxRows <= m; m0 += kMaxRows) group_pass<T, kMaxRows, Out>(a, n0, count, step, m0);
  const int64_t left = m - m0;
  if (left >= 4 && kMaxRows > 4) group_pass<T, 4, Out>(a, n0, count, step, m0), m0 += 4;
  switch (m - m0) {
    case 3: group_pass<T, 3, Out>(a, n0, count, step, m0); break;
    case 2: group_pass<T, 2, Out>(a, n0, count, step, m0); break;
    case 1: group_pass<T, 1, Out>(a, n0, count, step, m0); break;
    default: break;
  }
}

// A thread's weight rows n0 .. n1 - 1 split into kGroup runs of h rows read side by side (group i: rows
// n0 + i, n0 + h + i, ...; the rows left over as one last group), so that kGroup rows far apart are in flight
// at once, as gguf_blocks.h's streamed_rows for the int8 kernels (Xeon, Llama-1B shapes, 1 row of x, weights
// cold, 2 threads: Q4_0 / Q4_1 ~1.5x the GB/s of adjacent rows). Each row's sums are the same as before.
template <int64_t T, typename Out>
void gemm(const Args& a, int64_t m) {
  at::parallel_for(0, (a.n + kGroup - 1) / kGroup, 4, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * kGroup, n1 = std::min(g1 * kGroup, a.n), h = (n1 - n0) / kGroup;
    for (int64_t i = 0; i < h; ++i) group<T, Out>(a, m, n0 + i, kGroup, h);
    if (n0 + kGroup * h < n1) group<T, Out>(a, m, n0 + kGroup * h, n1 - n0 - kGroup * h, 1);
  });
}

}  // namespace pagedserve::gguf::decode

#endif
