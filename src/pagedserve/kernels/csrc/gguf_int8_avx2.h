// gguf_int8.h's vector code for the avx2 build (AVX2 + FMA + F16C): 32-byte vectors, a 256-weight group in 8
// of them (each a sub-block of 32 of the k-quants, or one block of 32), one weight row rebuilt at a time (16
// ymm registers); dot products by vpmaddubsw + vpmaddwd. No VNNI (its VEX form, AVX-VNNI, is left for later):
// no Q8_0. Included by gguf_int8.h only.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"

namespace pagedserve::gguf::int8 {

using IVec = __m256i;
using FVec = __m256;
constexpr int kBytes = 32, kLanes = 8, kVecs = 8, kOffsetVecs = 2, kPair = 1;
using Block = Rebuilt<IVec, FVec, kVecs, kOffsetVecs>;
inline IVec iload(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IVec izero() { return _mm256_setzero_si256(); }
inline FVec fload(const float* p) { return _mm256_loadu_ps(p); }
inline void fstore(float* p, FVec v) { _mm256_storeu_ps(p, v); }
inline FVec fset1(float v) { return _mm256_set1_ps(v); }
inline FVec fmul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
inline FVec fmadd(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
inline FVec cvt(IVec v) { return _mm256_cvtepi32_ps(v); }
inline float hsum(FVec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
// 0xFF in byte j where bit j of bits is set
inline __m256i bit_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// max |x| over len values (a multiple of 8)
inline float abs_max(const float* x, int64_t len) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps();
  for (int64_t j = 0; j < len; j += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(x + j), sign));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

// 16 values times scale to the nearest integer (ties to even: MXCSR's default), clamped to +-127, as bytes at
// q; returns their sum
inline int32_t quantize16(const float* x, float scale, int8_t* q) {
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
  __m256i v0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), s));
  __m256i v1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), s));
  v0 = _mm256_max_epi32(_mm256_min_epi32(v0, hi), lo), v1 = _mm256_max_epi32(_mm256_min_epi32(v1, hi), lo);
  // int32 -> int16 (128-bit lanes interleaved, put back in order) -> int8
  const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(v0, v1), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q),
                   _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1)));
  return hsum_epi32(_mm256_add_epi32(v0, v1));
}

// The 8 rebuilt blocks of 32 of a group (quants q, scales d) into u's vectors, one block each.
inline void set_small(const __m256i* q, const float* d, Block& u) {
  for (int v = 0; v < 8; ++v) u.q[v] = q[v], u.scale[v] = _mm256_set1_ps(d[v]);
}

template <int64_t T>
inline void rebuild(const uint8_t* b, Block& u) {
  alignas(32) float offsets[16];
  const __m256i low4 = _mm256_set1_epi8(15);
  if constexpr (T == kQ4_K || T == kQ5_K) {
    uint8_t sm[16];  // scales of sub-blocks 0..7, then their mins (ggml's get_scale_min_k4)
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      scale_min_k4(j, b + 4, sc, mn);
      sm[j] = static_cast<uint8_t>(sc), sm[8 + j] = static_cast<uint8_t>(mn);
    }
    const float dmin = f16(b + 2);
    for (int j = 0; j < 16; ++j) offsets[j] = -dmin * static_cast<float>(sm[8 + j / 2]);
    u.d = _mm256_set1_ps(f16(b));
    // 32 bytes per 64 weights: low nibbles sub-block 2c, high nibbles 2c + 1; Q5_K's fifth bit of sub-block v
    // is bit v of qh[l]
    const uint8_t* qs = b + (T == kQ5_K ? 48 : 16);
    const __m256i qh =
        T == kQ5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      u.q[2 * c] = _mm256_and_si256(bytes, low4);
      u.q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
    }
    for (int v = 0; v < 8; ++v) {
      if constexpr (T == kQ5_K) {
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, v), _mm256_set1_epi8(1));
        u.q[v] = _mm256_or_si256(u.q[v], _mm256_slli_epi16(bit, 4));
      }
      u.sc[v] = _mm256_set1_epi16(sm[v]);
    }
  } else if constexpr (T == kQ6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    for (int j = 0; j < 16; ++j) offsets[j] = -32.f * d * static_cast<float>(sc[j]);
    u.d = _mm256_set1_ps(d);
    // weights 128 c + 32 j + l: ql[64 c + l] (j = 0) and ql[64 c + 32 + l] (j = 1) low nibbles, the same
    // bytes' high nibbles (j = 2, 3); high bits (qh[32 c + l] >> 2 j) & 3
    const __m256i low2 = _mm256_set1_epi8(3);
    for (int c = 0; c < 2; ++c) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * c));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * c + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * c));
      const __m256i nibbles[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                                  _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                  _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
      for (int j = 0; j < 4; ++j) {
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), low2);
        u.q[4 * c + j] = _mm256_or_si256(nibbles[j], _mm256_slli_epi16(high, 4));
      }
    }
    // vector v holds the groups of 16 2 v and 2 v + 1: int16 lanes 0..7 and 8..15
    for (int v = 0; v < 8; ++v)
      u.sc[v] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * v + 1]), _mm_set1_epi16(sc[2 * v]));
  }
  u.offsets[0] = _mm256_load_ps(offsets), u.offsets[1] = _mm256_load_ps(offsets + 8);
}

// acc += (unsigned bytes w . signed bytes x, in pairs) * int16 scales, in int32 lanes
// dot4: unsigned bytes w . signed bytes x in fours, into int32 lanes (no scales; w < 128)
struct DotPlain {
  static inline __m256i dot(__m256i acc, __m256i w, __m256i x, __m256i sc) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), sc));
  }
  static inline __m256i dot4(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
  }
};

inline bool cpu_has_vnni() { return false; }

}  // namespace pagedserve::gguf::int8
