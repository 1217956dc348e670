// Hand-vectorized decode GEMM (a few rows of x) over raw Q4_0 / Q4_1 / Q8_0 blocks, for the avx512 / amx
// variants (16 float lanes) and avx2 (AVX2 + FMA + F16C, 8 lanes); the baseline build defines nothing here
// and gguf_gemm.cpp keeps its portable loop.
//
// Decode reads every weight once per token, so the work per block of 32 weights must cost less than reading
// its 18-34 bytes (about 1 ns per block per core at this machine's ~11 GB/s per thread). The portable loop
// rebuilds a block into a float buffer with a scalar fp16 conversion and multiplies it in a second pass;
// here a block is rebuilt in registers and used at once:
//   - the fp16 scales of a block widen in one F16C instruction (d and m are its first 4 bytes);
//   - the quants widen with vpmovzx/sx to int32 and convert to float, then w = d * q (+ m) in one multiply
//     or fused multiply-add. d * q is exact in float32 (an 11-bit mantissa times at most 8 bits), so w is
//     bit for bit the float dequant_gguf returns: the results differ from dequant_gguf(W) @ x only by the
//     order of the float32 sums;
//   - every rebuilt weight vector is multiplied into all MR rows of x at once (x stays in L1), into
//     R x MR independent accumulators: R weight rows at a time hide the FMA latency even for one row of x;
//   - while R rows are multiplied, the next R rows (contiguous bytes) are prefetched, a few lines per block.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define PAGEDSERVE_GGUF_DECODE 1

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "gguf_blocks.h"

namespace pagedserve::gguf::decode {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16, kAccumulators = 16;  // of 32 zmm registers: the rest hold weights and scales
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
using Vec = __m256;
constexpr int kLanes = 8, kAccumulators = 8;  // of 16 ymm registers
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float hsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif
constexpr int kVecs = 32 / kLanes;  // vectors per block

template <int64_t T>
constexpr bool kFast = T == kQ4_0 || T == kQ4_1 || T == kQ8_0;

// Block b's 32 weights as float32, w[v] = weights kLanes * v .. + kLanes - 1.
template <int64_t T>
inline void unpack(const uint8_t* b, Vec* w) {
  // d (and Q4_1's m): the block's first 4 bytes as two fp16 (Q4_0 / Q8_0 read two quant bytes as the
  // second, unused).
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u32(b))));
#if defined(__AVX512F__)
  const Vec d = _mm512_broadcastss_ps(dm);
  if constexpr (T == kQ8_0) {
    const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
    w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
  } else {
    // byte j holds q[j] (low nibble) and q[j + 16] (high nibble)
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (T == kQ4_1 ? 4 : 2))));
    __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(q, 4);
    if constexpr (T == kQ4_1) {
      const Vec m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
      w[0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lo), m);
      w[1] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(hi), m);
    } else {
      const __m512i eight = _mm512_set1_epi32(8);
      w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight)));
      w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight)));
    }
  }
#else
  const Vec d = _mm256_broadcastss_ps(dm);
  if constexpr (T == kQ8_0) {
    for (int v = 0; v < 4; ++v) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * v));
      w[v] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  } else {
    const uint8_t* qs = b + (T == kQ4_1 ? 4 : 2);
    const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
    const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
    const __m256i fifteen = _mm256_set1_epi32(15);
    __m256i q[4] = {_mm256_and_si256(q0, fifteen), _mm256_and_si256(q1, fifteen), _mm256_srli_epi32(q0, 4),
                    _mm256_srli_epi32(q1, 4)};
    if constexpr (T == kQ4_1) {
      const Vec m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
      for (int v = 0; v < 4; ++v) w[v] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[v]), m);
    } else {
      for (int v = 0; v < 4; ++v)
        w[v] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[v], _mm256_set1_epi32(8))));
    }
  }
#endif
}

struct Args {
  const float* x;  // [m, k] float32, rows at x_stride
  int64_t x_stride, k;
  const uint8_t* w;  // [n, row_bytes]
  int64_t n, row_bytes;
  const float* bias;  // [n] or null
  void* y;            // [m, n] float or c10::BFloat16, contiguous
};

// R weight rows from n0 times MR rows of x from m0.
template <int64_t T, int R, int MR, typename Out>
void tile(const Args& a, int64_t n0, int64_t m0) {
  constexpr int64_t B = Format<T>::kBytes;
  const int64_t nb = a.k / 32;
  const uint8_t* row = a.w + n0 * a.row_bytes;  // rows n0 .. n0 + R - 1 lie back to back
  const uint8_t* next = row + R * a.row_bytes;   // the next tile's rows: prefetched R * B bytes per block
  Vec acc[R][MR];
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < MR; ++r) acc[i][r] = zero();
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t off = 0; off < R * B; off += 64) _mm_prefetch(reinterpret_cast<const char*>(next + b * R * B + off), _MM_HINT_T0);
    for (int i = 0; i < R; ++i) {
      Vec w[kVecs];
      unpack<T>(row + i * a.row_bytes + b * B, w);
      for (int r = 0; r < MR; ++r) {
        const float* xr = a.x + (m0 + r) * a.x_stride + 32 * b;
        for (int v = 0; v < kVecs; ++v) acc[i][r] = fma(w[v], load(xr + kLanes * v), acc[i][r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    Out* y = static_cast<Out*>(a.y) + (m0 + r) * a.n + n0;
    for (int i = 0; i < R; ++i) y[i] = static_cast<Out>(hsum(acc[i][r]) + (a.bias ? a.bias[n0 + i] : 0.f));
  }
}

// Rows n0 .. n1 of w (n1 - n0 <= kGroup) against all m rows of x, in passes of MR rows of x.
constexpr int kGroup = 4;

template <int64_t T, int MR, typename Out>
void group_pass(const Args& a, int64_t n0, int64_t n1, int64_t m0) {
  constexpr int R = kAccumulators / MR >= kGroup ? kGroup : (kAccumulators / MR >= 1 ? kAccumulators / MR : 1);
  int64_t n = n0;
  for (; n + R <= n1; n += R) tile<T, R, MR, Out>(a, n, m0);
  for (; n < n1; ++n) tile<T, 1, MR, Out>(a, n, m0);
}

template <int64_t T, typename Out>
void gemm(const Args& a, int64_t m) {
  constexpr int kMaxRows = kAccumulators >= 16 ? 8 : 4;
  const int64_t groups = (a.n + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * kGroup, n1 = std::min(n0 + kGroup, a.n);
      int64_t m0 = 0;
      for (; m0 + kMaxRows <= m; m0 += kMaxRows) group_pass<T, kMaxRows, Out>(a, n0, n1, m0);
      const int64_t left = m - m0;
      if (left >= 4 && kMaxRows > 4) group_pass<T, 4, Out>(a, n0, n1, m0), m0 += 4;
      switch (m - m0) {
        case 3: group_pass<T, 3, Out>(a, n0, n1, m0); break;
        case 2: group_pass<T, 2, Out>(a, n0, n1, m0); break;
        case 1: group_pass<T, 1, Out>(a, n0, n1, m0); break;
        default: break;
      }
    }
  });
}

}  // namespace pagedserve::gguf::decode

#endif
