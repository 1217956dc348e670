// Block GEMM with int8 activations for a few rows of x (batched decode), where the float kernels of
// gguf_decode.h are bound by their float32 FMAs rather than by reading the weights. As llama.cpp does, each
// row of x is quantized to int8 in groups of 256 values (one float scale dx per group, the nearest integer
// of x / dx with dx = max|x| / 127), and the weights' integer quants, as unsigned bytes, are multiplied into
// it with integer dot products:
//   - k-quants (Q4_K, Q5_K, Q6_K: integer scales per 16 or 32 weights under one d per 256): vpmaddubsw
//     (quants 0..63 times x, pairs summed into int16: at most 2 * 63 * 127, never saturates), then
//     vpdpwssd (AVX512-VNNI) or vpmaddwd + vpaddd: times the sub-block's integer scale into int32 lanes over
//     the whole block, and one float multiply-add per block by d * dx;
//   - blocks of 32 with a float d each (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): vpdpbusd (VNNI; else vpmaddubsw +
//     vpmaddwd by ones) into int32 lanes, 8 per block, each scaled by its block's d in float; Q8_0's signed
//     quants go in offset by 128 (unsigned), whose pair sums would saturate vpmaddubsw: VNNI only;
//   - every type's offset (the weight of quant 0: Q4_K / Q5_K's - dmin * min, Q6_K's - 32 * d * scale,
//     Q4_0's - 8 d, Q4_1's m, Q8_0's - 128 d, ...) times the sum of x over the same 16 values: one float
//     multiply-add of 16 lanes per 256 weights; x's sums per 16 come with its quants (dx * sum of quants).
// So y = sum over blocks of w . x^ exactly in integers, where x^ = dx * round(x / dx), up to float32
// rounding of a few products per block: against float x the error is at most sum_k |w_k| dx / 2.
//
// The weights of R rows are rebuilt once per 256 into registers (quants as bytes in the order of x, scales
// as int16 or float vectors, offsets as floats) and multiplied into every row of x (at most kMaxRows per
// pass, the float accumulators of a pass in a small buffer in L1). VNNI is a run-time choice: the avx512
// and amx builds compile both dot products (the VNNI one under a function target attribute) and take
// VNNI where the CPU has avx512_vnni. Builds without AVX512-BW (avx2, baseline) define no int8 kernel:
// gguf_int8_types() is empty there and the dispatcher (model/layers/gguf_quant.py) keeps the float paths.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDSERVE_GGUF_INT8 1

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"

namespace pagedserve::gguf::int8 {

constexpr int64_t kGroup = 256;   // x values per quantization scale
constexpr int64_t kMaxRows = 64;  // rows of x per pass over the weights

// Types with integer scales per 16 or 32 weights under one float d per 256 (k-quants: the scales multiply the
// int16 pair sums); types with a float d per 32 weights (each 32-lane int32 sum scaled by its d in float).
template <int64_t T>
constexpr bool kIntScales = T == kQ4_K || T == kQ5_K || T == kQ6_K;
template <int64_t T>
constexpr bool kFloatScales = T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1 || T == kQ8_0;
// Q8_0's quants, offset by 128 to unsigned bytes, reach 255: their pair sums saturate vpmaddubsw's int16, so
// Q8_0 needs VNNI's vpdpbusd (4 products straight into int32).
template <int64_t T>
constexpr bool kSupported = kIntScales<T> || kFloatScales<T>;
template <int64_t T>
constexpr bool kNeedsVnni = T == kQ8_0;

// x as int8: rows of kpad (K rounded up to whole groups, zero padded) quants, per group its scale and the
// scaled sums of its 16-value runs.
struct Quantized {
  const int8_t* q;    // [m, kpad]
  const float* d;     // [m, groups]
  const float* s16;   // [m, groups * 16]
  int64_t kpad, groups;
};

// One row of k float32 values (k a multiple of 32) into q, d and s16 as Quantized lays them out.
inline void quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* s16) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t g = 0; g * kGroup < k; ++g) {
    const float* xg = x + g * kGroup;
    const int64_t len = std::min(kGroup, k - g * kGroup);
    __m512 amax = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 16) amax = _mm512_max_ps(amax, _mm512_and_ps(_mm512_loadu_ps(xg + j), sign));
    const float top = _mm512_reduce_max_ps(amax);
    const float inv = top > 0.f ? 127.f / top : 0.f;
    d[g] = top / 127.f;
    const __m512 scale = _mm512_set1_ps(inv);
    int8_t* qg = q + g * kGroup;
    for (int64_t j = 0; j < kGroup; j += 16) {
      if (j >= len) {  // padding of the last group: zero quants, zero sums
        std::memset(qg + j, 0, 16);
        s16[g * 16 + j / 16] = 0.f;
        continue;
      }
      // nearest integer, ties to even (MXCSR's default), as torch.round: the tests emulate it
      __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + j), scale));
      v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + j), _mm512_cvtepi32_epi8(v));
      s16[g * 16 + j / 16] = d[g] * static_cast<float>(_mm512_reduce_add_epi32(v));
    }
  }
}

// A 256-weight block of one weight row, rebuilt: quants as unsigned bytes in x's order (64 per vector),
// the int16 scale of each vpmaddubsw lane (a pair of weights), the offsets per 16 weights and d.
struct Block {
  __m512i q[4];
  __m512i sc[4];    // kIntScales: each int16 lane's scale
  __m512 scale[4];  // kFloatScales: each int32 lane's d (8 lanes per block of 32)
  __m512 offsets;
  __m512 d;         // kIntScales
};

// int16 lanes of `scales` (32 x int16, of which the first 8 or 16 are used) picked by idx[lane].
inline __m512i pick16(__m512i scales, __m512i idx) { return _mm512_permutexvar_epi16(idx, scales); }

// idx: lane l of vector v takes scale (64 v + 2 l) / group: group = 32 (Q4_K, Q5_K) or 16 (Q6_K)
template <int Group>
inline __m512i scale_index(int v) {
  alignas(64) int16_t idx[32];
  for (int l = 0; l < 32; ++l) idx[l] = static_cast<int16_t>((64 * v + 2 * l) / Group);
  return _mm512_load_si512(idx);
}

// The 32 quants of a block of 32 as unsigned bytes in x's order, and its d and offset (the weight of quant 0).
template <int64_t T>
inline __m256i small_block(const uint8_t* b, float& d, float& offset) {
  d = f16(b);
  if constexpr (T == kQ8_0) {
    offset = -128.f * d;  // q + 128
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), _mm256_set1_epi8(-128));
  } else {
    constexpr int at = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ5_0 ? 6 : 8;
    offset = T == kQ4_0 ? -8.f * d : T == kQ5_0 ? -16.f * d : f16(b + 2);
    // byte j: weight j (low nibble), weight j + 16 (high nibble)
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + at));
    const __m128i low4 = _mm_set1_epi8(15);
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), _mm_and_si128(bytes, low4));
    if constexpr (T == kQ5_0 || T == kQ5_1)  // bit j of qh: the fifth bit of weight j
      q = _mm256_mask_add_epi8(q, static_cast<__mmask32>(u32(b + (T == kQ5_0 ? 2 : 4))), q, _mm256_set1_epi8(16));
    return q;
  }
}

// Group g of 256 weights (8 blocks of 32, fewer in a row's last group: the rest zero) from row `row` of nb
// blocks.
template <int64_t T>
inline void rebuild_small(const uint8_t* row, int64_t g, int64_t nb, Block& u) {
  constexpr int64_t B = Format<T>::kBytes;
  alignas(64) float d[8], offsets[16];
  __m256i q[8];
  for (int j = 0; j < 8; ++j) {
    if (8 * g + j < nb) {
      q[j] = small_block<T>(row + (8 * g + j) * B, d[j], offsets[2 * j]);
    } else {
      q[j] = _mm256_setzero_si256(), d[j] = 0.f, offsets[2 * j] = 0.f;
    }
    offsets[2 * j + 1] = offsets[2 * j];
  }
  for (int v = 0; v < 4; ++v) {
    u.q[v] = _mm512_inserti64x4(_mm512_castsi256_si512(q[2 * v]), q[2 * v + 1], 1);
    u.scale[v] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d[2 * v]), _mm512_set1_ps(d[2 * v + 1]));
  }
  u.offsets = _mm512_load_ps(offsets);
}

template <int64_t T>
inline void rebuild(const uint8_t* b, Block& u) {
  if constexpr (T == kQ4_K || T == kQ5_K) {
    // the 8 six-bit scales and mins (ggml's get_scale_min_k4, 4 bytes at a time)
    uint32_t s[4];
    std::memcpy(s, b + 4, 12);
    constexpr uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
    s[3] = ((s[2] >> 4) & m4) | (((s[1] >> 6) & m2) << 4);
    const uint32_t mins_lo = s[1] & m6;
    s[1] = (s[2] & m4) | (((s[0] >> 6) & m2) << 4);
    s[2] = mins_lo;
    s[0] &= m6;
    // bytes 0..7: scales of sub-blocks 0..7; bytes 8..15: mins
    const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(sm));
    for (int v = 0; v < 4; ++v) u.sc[v] = pick16(sc16, scale_index<32>(v));
    // offsets per 16 weights: - dmin * min of their sub-block of 32
    const __m128i mins2 =
        _mm_shuffle_epi8(sm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15));
    u.offsets = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mins2)), _mm512_set1_ps(-f16(b + 2)));
    u.d = _mm512_set1_ps(f16(b));
    // 32 bytes per 64 weights: low nibbles weights 0..31, high nibbles 32..63; a 64-byte load holds two such
    // runs, regrouped by 128-bit lanes into weights 0..63 and 64..127
    const uint8_t* qs = b + (T == kQ5_K ? 48 : 16);
    const __m512i low4 = _mm512_set1_epi8(15);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (T == kQ5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __m512i qh2 = _mm512_broadcast_i64x4(qh);
    for (int h = 0; h < 2; ++h) {
      const __m512i bytes = _mm512_loadu_si512(qs + 64 * h);
      const __m512i lo = _mm512_and_si512(bytes, low4), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
      u.q[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);
      u.q[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);
    }
    if constexpr (T == kQ5_K) {
      // the fifth bit of weight 64 c + l is bit 2 c of qh[l], of weight 64 c + 32 + l bit 2 c + 1
      for (int c = 0; c < 4; ++c) {
        const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (2 * c))),
                                               _mm256_set1_epi8(static_cast<char>(1 << (2 * c + 1))), 1);
        const __mmask64 set = _mm512_test_epi8_mask(qh2, bit);
        u.q[c] = _mm512_mask_add_epi8(u.q[c], set, u.q[c], _mm512_set1_epi8(16));
      }
    }
  } else if constexpr (T == kQ6_K) {
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const float d = f16(b + 208);
    const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
    for (int v = 0; v < 4; ++v) u.sc[v] = pick16(sc16, scale_index<16>(v));
    u.offsets = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)), _mm512_set1_ps(-32.f * d));
    u.d = _mm512_set1_ps(d);
    // weights 128 c + 0..63: low nibbles of ql[64 c .. 64 c + 63], high bits (qh[32 c + l] >> 0 / 2) & 3;
    // weights 128 c + 64..127: high nibbles of the same bytes, high bits (qh >> 4 / 6) & 3
    const __m512i low4 = _mm512_set1_epi8(15), low2 = _mm512_set1_epi8(3);
    for (int c = 0; c < 2; ++c) {
      const __m512i ql = _mm512_loadu_si512(b + 64 * c);
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * c)));
      const __m512i hi_lo = _mm512_and_si512(
          _mm512_srlv_epi16(qh, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1)), low2);
      const __m512i hi_hi = _mm512_and_si512(
          _mm512_srlv_epi16(qh, _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1)), low2);
      u.q[2 * c] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(hi_lo, 4));
      u.q[2 * c + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_slli_epi16(hi_hi, 4));
    }
  }
}

// acc += (unsigned bytes w . signed bytes x, in pairs) * int16 scales, in int32 lanes
// dot4: unsigned bytes w . signed bytes x in fours, into int32 lanes (no scales)
struct DotBw {
  static inline __m512i dot(__m512i acc, __m512i w, __m512i x, __m512i sc) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), sc));
  }
  static inline __m512i dot4(__m512i w, __m512i x) {  // w < 128: pair sums within int16
    return _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1));
  }
};

#pragma GCC push_options
#pragma GCC target("avx512vnni")
struct DotVnni {
  static inline __m512i dot(__m512i acc, __m512i w, __m512i x, __m512i sc) {
    return _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(w, x), sc);
  }
  static inline __m512i dot4(__m512i w, __m512i x) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x); }
};
#pragma GCC pop_options

struct Args {
  Quantized x;
  int64_t m, k;
  const uint8_t* w;  // [n, row_bytes]
  int64_t n, row_bytes;
  const float* bias;  // [n] or null
  void* y;            // [m, n] float or c10::BFloat16
};

// Weight rows n0 .. n0 + R - 1 times rows m0 .. m0 + rows - 1 of x, into acc[R][rows][16].
template <int64_t T, class Dot, int R>
[[gnu::always_inline]] inline void pass(const Args& a, int64_t n0, int64_t m0, int64_t rows, float* acc) {
  constexpr int64_t B = Format<T>::kBytes, E = Format<T>::kElems;
  const uint8_t* w = a.w + n0 * a.row_bytes;
  for (int64_t b = 0; b < a.x.groups; ++b) {
    Block u[R];
    const int64_t at = b * kGroup / E * B, bytes = kGroup / E * B;  // group b's bytes in a row
    for (int i = 0; i < R; ++i) {
      const uint8_t* row = w + i * a.row_bytes;
      for (int64_t off = 0; off < bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + at + 1024 + off), _MM_HINT_T0);
      if constexpr (kIntScales<T>) rebuild<T>(row + at, u[i]);
      else rebuild_small<T>(row, b, a.k / E, u[i]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = m0 + r;
      const int8_t* xq = a.x.q + row * a.x.kpad + b * kGroup;
      __m512i xv[4];
      for (int v = 0; v < 4; ++v) xv[v] = _mm512_loadu_si512(xq + 64 * v);
      const __m512 s16 = _mm512_loadu_ps(a.x.s16 + (row * a.x.groups + b) * 16);
      const __m512 dx = _mm512_set1_ps(a.x.d[row * a.x.groups + b]);
      for (int i = 0; i < R; ++i) {
        float* out = acc + (i * rows + r) * 16;
        __m512 sum;
        if constexpr (kIntScales<T>) {
          __m512i s = _mm512_setzero_si512();
          for (int v = 0; v < 4; ++v) s = Dot::dot(s, u[i].q[v], xv[v], u[i].sc[v]);
          sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(u[i].d, dx), _mm512_load_ps(out));
        } else {
          __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(Dot::dot4(u[i].q[0], xv[0])), u[i].scale[0]);
          for (int v = 1; v < 4; ++v)
            f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Dot::dot4(u[i].q[v], xv[v])), u[i].scale[v], f);
          sum = _mm512_fmadd_ps(f, dx, _mm512_load_ps(out));
        }
        _mm512_store_ps(out, _mm512_fmadd_ps(u[i].offsets, s16, sum));
      }
    }
  }
}

template <int64_t T, class Dot, int R, typename Out>
[[gnu::always_inline]] inline void tile(const Args& a, int64_t n0) {
  alignas(64) float acc[R * kMaxRows * 16];
  for (int64_t m0 = 0; m0 < a.m; m0 += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, a.m - m0);
    std::memset(acc, 0, sizeof(float) * R * rows * 16);
    pass<T, Dot, R>(a, n0, m0, rows, acc);
    for (int64_t r = 0; r < rows; ++r) {
      Out* y = static_cast<Out*>(a.y) + (m0 + r) * a.n + n0;
      for (int i = 0; i < R; ++i)
        y[i] = static_cast<Out>(_mm512_reduce_add_ps(_mm512_load_ps(acc + (i * rows + r) * 16)) +
                                (a.bias ? a.bias[n0 + i] : 0.f));
    }
  }
}

// Weight rows n0 .. n1 - 1: two at a time (the rebuilt blocks of both stay in registers), then one.
template <int64_t T, class Dot, typename Out>
[[gnu::always_inline]] inline void rows(const Args& a, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) tile<T, Dot, 2, Out>(a, n);
  for (; n < n1; ++n) tile<T, Dot, 1, Out>(a, n);
}

template <int64_t T, typename Out>
[[gnu::noinline]] void rows_bw(const Args& a, int64_t n0, int64_t n1) {
  rows<T, DotBw, Out>(a, n0, n1);
}

template <int64_t T, typename Out>
[[gnu::noinline, gnu::target("avx512vnni")]] void rows_vnni(const Args& a, int64_t n0, int64_t n1) {
  rows<T, DotVnni, Out>(a, n0, n1);
}

inline bool cpu_has_vnni() { return __builtin_cpu_supports("avx512vnni"); }

template <int64_t T, typename Out>
void gemm(const Args& a, bool vnni) {
  if constexpr (kSupported<T>) {
    TORCH_CHECK(vnni || !kNeedsVnni<T>, "gemm_gguf_int8: GGML type ", T, " needs AVX512-VNNI");
    // threads split the weight rows in pairs; every thread reads all of x (a few KB per row, in L2)
    at::parallel_for(0, (a.n + 1) / 2, 8, [&](int64_t p0, int64_t p1) {
      const int64_t n0 = 2 * p0, n1 = std::min(2 * p1, a.n);
      if constexpr (kNeedsVnni<T>) rows_vnni<T, Out>(a, n0, n1);
      else vnni ? rows_vnni<T, Out>(a, n0, n1) : rows_bw<T, Out>(a, n0, n1);
    });
  }
}

}  // namespace pagedserve::gguf::int8

#endif
