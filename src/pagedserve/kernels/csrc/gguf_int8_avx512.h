// gguf_int8.h's vector code for the avx512 and amx builds: 64-byte vectors, a 256-weight group in 4 of them,
// two weight rows rebuilt at a time; both dot products (AVX512-BW's vpmaddubsw + vpmaddwd, and VNNI's vpdpwssd /
// vpdpbusd under a function target attribute, for CPUs with avx512_vnni). Included by gguf_int8.h only.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"

#define PAGEDSERVE_GGUF_INT8_VNNI 1

namespace pagedserve::gguf::int8 {

using IVec = __m512i;
using FVec = __m512;
constexpr int kBytes = 64, kLanes = 16, kVecs = 4, kOffsetVecs = 1, kPair = 2;
using Block = Rebuilt<IVec, FVec, kVecs, kOffsetVecs>;
inline IVec iload(const int8_t* p) { return _mm512_loadu_si512(p); }
inline IVec izero() { return _mm512_setzero_si512(); }
inline FVec fload(const float* p) { return _mm512_loadu_ps(p); }
inline void fstore(float* p, FVec v) { _mm512_storeu_ps(p, v); }
inline FVec fset1(float v) { return _mm512_set1_ps(v); }
inline FVec fmul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
inline FVec fmadd(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
inline FVec cvt(IVec v) { return _mm512_cvtepi32_ps(v); }
inline float hsum(FVec v) { return _mm512_reduce_add_ps(v); }
// 0xFF in byte j where bit j of bits is set
inline __m256i bit_bytes(uint32_t bits) { return _mm256_movm_epi8(static_cast<__mmask32>(bits)); }

// max |x| over len values (a multiple of 16)
inline float abs_max(const float* x, int64_t len) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 amax = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; j += 16) amax = _mm512_max_ps(amax, _mm512_and_ps(_mm512_loadu_ps(x + j), sign));
  return _mm512_reduce_max_ps(amax);
}

// 16 values times scale to the nearest integer (ties to even: MXCSR's default), clamped to +-127, as bytes at
// q; returns their sum
inline int32_t quantize16(const float* x, float scale, int8_t* q) {
  __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(scale)));
  v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(v));
  return _mm512_reduce_add_epi32(v);
}

// The 8 rebuilt blocks of 32 of a group (quants q, scales d) into u's vectors, two blocks each.
inline void set_small(const __m256i* q, const float* d, Block& u) {
  for (int v = 0; v < 4; ++v) {
    u.q[v] = _mm512_inserti64x4(_mm512_castsi256_si512(q[2 * v]), q[2 * v + 1], 1);
    u.scale[v] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d[2 * v]), _mm512_set1_ps(d[2 * v + 1]));
  }
}

// int16 lanes of `scales` (32 x int16, of which the first 8 or 16 are used) picked by idx[lane].
inline __m512i pick16(__m512i scales, __m512i idx) { return _mm512_permutexvar_epi16(idx, scales); }

// idx: lane l of vector v takes scale (64 v + 2 l) / group: group = 32 (Q4_K, Q5_K) or 16 (Q6_K)
template <int Group>
inline __m512i scale_index(int v) {
  alignas(64) int16_t idx[32];
  for (int l = 0; l < 32; ++l) idx[l] = static_cast<int16_t>((64 * v + 2 * l) / Group);
  return _mm512_load_si512(idx);
}

template <int64_t T>
inline void rebuild(const uint8_t* b, Block& u) {
  if constexpr (T == kQ4_K || T == kQ5_K) {
    // bytes 0..7: scales of sub-blocks 0..7; bytes 8..15: mins
    const __m128i sm = k4_scales_mins(b);
    const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(sm));
    for (int v = 0; v < 4; ++v) u.sc[v] = pick16(sc16, scale_index<32>(v));
    // offsets per 16 weights: - dmin * min of their sub-block of 32
    const __m128i mins2 =
        _mm_shuffle_epi8(sm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15));
    u.offsets[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mins2)), _mm512_set1_ps(-f16(b + 2)));
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
    u.offsets[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)), _mm512_set1_ps(-32.f * d));
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
struct DotPlain {
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

inline bool cpu_has_vnni() { return __builtin_cpu_supports("avx512vnni"); }

}  // namespace pagedserve::gguf::int8
