// GGUF blocks rebuilt as float32 vectors in registers, for the decode GEMM of gguf_decode.h: avx512 / amx
// (16 lanes) and avx2 with FMA and F16C (8 lanes). Rebuild<T>(block).sub(j, w) gives weights 32j .. 32j + 31
// of the block as kVecs vectors, each bit for bit the float dequant_block<T> (gguf_blocks.h) returns: the
// same products in the same order, and where a product is exact (an fp16 scale times a small integer) one
// fused multiply-add that rounds once where dequant_block rounds once after the product.
//
// Decode reads each weight once per token, so the work per block must cost less than reading its bytes
// (Q4_K: 144 bytes per 256 weights):
//   - a block's scales (the K-quants' 6-bit scales and mins, Q6_K's int8 scales, IQ4_XS's 6-bit scales)
//     are widened and multiplied by d once per block, 4-16 at a time, into a small float array that the
//     sub-blocks read as broadcast loads;
//   - Q4_K and IQ4_XS on avx512: one multiply(-add) builds the 16 weights a nibble can stand for in the
//     sub-block, d1 * k - m1 or dl * value[k], and vpermps looks the 32 nibbles up in it (it reads only an
//     index's low 4 bits, so the zero-extended bytes index their low nibbles as they are);
//   - otherwise the 32 quants of a sub-block are put together as bytes in one 256-bit register (shifts and
//     masks on 32 at a time), widened to int32 and float, and scaled: w = d1 * q - m1 (Q4_K, Q5_K),
//     (d * sc) * q (Q6_K), dl * value (IQ4_XS on avx2: values looked up by vpshufb), d * q (+ m) (Q5_0,
//     Q5_1; the fifth bits spread to bytes by a mask move on avx512, a byte compare on avx2).
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define PAGEDSERVE_GGUF_DECODE 1

#include <immintrin.h>

#include <cstdint>

#include "gguf_blocks.h"

namespace pagedserve::gguf::decode {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16, kAccumulators = 16;  // of 32 zmm registers: the rest hold weights and scales
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec set1(float v) { return _mm512_set1_ps(v); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec fms(Vec a, Vec b, Vec c) { return _mm512_fmsub_ps(a, b, c); }
inline float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
// the 32 signed bytes of q as floats
inline void widen(__m256i q, Vec* f) {
  f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
  f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
}
// 16 bytes from p zero-extended to int32 lanes: vpermps indices
inline __m512i indices(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#else
using Vec = __m256;
constexpr int kLanes = 8, kAccumulators = 8;  // of 16 ymm registers
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec set1(float v) { return _mm256_set1_ps(v); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec fms(Vec a, Vec b, Vec c) { return _mm256_fmsub_ps(a, b, c); }
inline float hsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline void widen(__m256i q, Vec* f) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
  f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
}
#endif
constexpr int kVecs = 32 / kLanes;  // vectors per 32 weights

inline __m128i bytes16(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline __m256i bytes32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m256i keep(__m256i v, int bits) { return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(bits))); }
// each byte shifted left by n bits (right for n < 0); what crosses into a neighbouring byte is the caller's
// to mask off
inline __m256i shift(__m256i v, int n) { return n >= 0 ? _mm256_slli_epi16(v, n) : _mm256_srli_epi16(v, -n); }
// 16 bytes of nibbles as 32 bytes: the low nibbles, then the high nibbles (the Q4_0 / Q5_0 / IQ4_XS order)
inline __m256i nibbles(__m128i q) { return keep(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), 15); }
// d (lane 0) and the next fp16 (lane 1) of a block
inline __m128 halves(const uint8_t* p) { return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u32(p)))); }

// Blocks of 32 weights: Q4_0, Q4_1, Q8_0.
template <int64_t T>
struct Rebuild {
  const uint8_t* b;
  explicit Rebuild(const uint8_t* blk) : b(blk) {}

  void sub(int, Vec* w) const {
    // d (and Q4_1's m): the block's first 4 bytes as two fp16 (Q4_0 / Q8_0 read two quant bytes as the
    // second, unused).
    const __m128 dm = halves(b);
#if defined(__AVX512F__)
    const Vec d = _mm512_broadcastss_ps(dm);
    if constexpr (T == kQ8_0) {
      const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
      w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
      w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
    } else {
      // byte j holds q[j] (low nibble) and q[j + 16] (high nibble)
      const __m512i q = indices(b + (T == kQ4_1 ? 4 : 2));
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
};

// Q5_0 / Q5_1: blocks of 32, w = d * (q - 16) or d * q + m, q's fifth bits in a u32.
template <int64_t T>
struct Q5 {
  const uint8_t* b;
  explicit Q5(const uint8_t* blk) : b(blk) {}

  void sub(int, Vec* w) const {
    const __m128 dm = halves(b);  // d, and Q5_1's m (Q5_0: two bytes of qh, unused)
    const float d = _mm_cvtss_f32(dm), m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    // bit j of qh is weight j's fifth bit: spread to byte j as 0x10
    const uint32_t qh = u32(b + (T == kQ5_1 ? 4 : 2));
#if defined(__AVX512F__)
    const __m256i fifth = _mm256_maskz_mov_epi8(static_cast<__mmask32>(qh), _mm256_set1_epi8(16));
#else
    const __m256i bits = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
    const __m256i spread = _mm256_shuffle_epi8(  // byte j <- byte j / 8 of qh
        _mm256_set1_epi32(static_cast<int>(qh)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i fifth = keep(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits), 16);
#endif
    __m256i q = _mm256_or_si256(nibbles(bytes16(b + (T == kQ5_1 ? 8 : 6))), fifth);
    if constexpr (T == kQ5_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    Vec f[kVecs];
    widen(q, f);
    for (int v = 0; v < kVecs; ++v) w[v] = T == kQ5_1 ? fma(set1(d), f[v], set1(m)) : mul(set1(d), f[v]);
  }
};
template <> struct Rebuild<kQ5_0> : Q5<kQ5_0> { using Q5::Q5; };
template <> struct Rebuild<kQ5_1> : Q5<kQ5_1> { using Q5::Q5; };

// Q4_K / Q5_K: 8 sub-blocks of 32, w = (d * sc) * q - dmin * mn.
template <int64_t T>
struct KQuant {
  const uint8_t* b;
  alignas(16) float s[16];  // d * scale of sub-block j at j, dmin * min at 8 + j

  explicit KQuant(const uint8_t* blk) : b(blk) {
    // the 12 scale bytes: bytes 0-3 hold scales 0-3 and bytes 4-7 mins 0-3 in their low 6 bits, and the top
    // 2 bits of scales / mins 4-7 in their top 2 bits; bytes 8-11 hold the low 4 bits of scales 4-7 (low
    // nibble) and mins 4-7 (high nibble)
    const __m128i a = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(u32(blk + 4))));
    const __m128i m = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(u32(blk + 8))));
    const __m128i c = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(u32(blk + 12))));
    const __m128i six = _mm_set1_epi32(63), top = _mm_set1_epi32(0x30);
    const __m128i sc_hi = _mm_or_si128(_mm_and_si128(c, _mm_set1_epi32(15)), _mm_and_si128(_mm_srli_epi32(a, 2), top));
    const __m128i mn_hi = _mm_or_si128(_mm_srli_epi32(c, 4), _mm_and_si128(_mm_srli_epi32(m, 2), top));
    const __m128 dd = halves(blk);
    const __m128 d = _mm_shuffle_ps(dd, dd, 0), dmin = _mm_shuffle_ps(dd, dd, 0x55);
    _mm_store_ps(s, _mm_mul_ps(d, _mm_cvtepi32_ps(_mm_and_si128(a, six))));
    _mm_store_ps(s + 4, _mm_mul_ps(d, _mm_cvtepi32_ps(sc_hi)));
    _mm_store_ps(s + 8, _mm_mul_ps(dmin, _mm_cvtepi32_ps(_mm_and_si128(m, six))));
    _mm_store_ps(s + 12, _mm_mul_ps(dmin, _mm_cvtepi32_ps(mn_hi)));
  }

  void sub(int j, Vec* w) const {
    // sub-blocks 2c and 2c + 1 are the low and high nibbles of the same 32 bytes; Q5_K's fifth bit of weight
    // l of sub-block j is bit j of qh[l]
    const uint8_t* q = b + (T == kQ5_K ? 48 : 16) + 32 * (j / 2);
    const Vec d1 = set1(s[j]), m1 = set1(s[8 + j]);
#if defined(__AVX512F__)
    if constexpr (T == kQ4_K) {
      const Vec table = fms(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), d1, m1);
      const __m512i q0 = indices(q), q1 = indices(q + 16), s4 = _mm512_set1_epi32(4 * (j & 1));
      w[0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(q0, s4), table);
      w[1] = _mm512_permutexvar_ps(_mm512_srlv_epi32(q1, s4), table);
      return;
    }
#endif
    __m256i x = keep(shift(bytes32(q), -4 * (j & 1)), 15);
    if constexpr (T == kQ5_K) x = _mm256_or_si256(x, keep(shift(bytes32(b + 16), 4 - j), 16));
    Vec f[kVecs];
    widen(x, f);
    for (int v = 0; v < kVecs; ++v) w[v] = fms(d1, f[v], m1);
  }
};
template <> struct Rebuild<kQ4_K> : KQuant<kQ4_K> { using KQuant::KQuant; };
template <> struct Rebuild<kQ5_K> : KQuant<kQ5_K> { using KQuant::KQuant; };

// Q6_K: 16 x 16 weights, w = (d * sc) * (q - 32).
template <>
struct Rebuild<kQ6_K> {
  const uint8_t* b;
  alignas(64) float s[16];  // d * scale of each 16 weights

  explicit Rebuild(const uint8_t* blk) : b(blk) {
    const float d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(blk[208] | (blk[209] << 8))));  // the last 2 bytes
#if defined(__AVX512F__)
    _mm512_store_ps(s, _mm512_mul_ps(set1(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(blk + 192)))));
#else
    const __m128i sc = bytes16(blk + 192);
    _mm256_store_ps(s, mul(set1(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_store_ps(s + 8, mul(set1(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc)))));
#endif
  }

  void sub(int j, Vec* w) const {
    // sub-block j = 4c + g of half c: low 4 bits from ql[64c + 32 (g & 1) + l] (low nibbles for g < 2, high
    // nibbles above), high 2 bits from bits 2g, 2g + 1 of qh[32c + l]
    const int c = j / 4, g = j % 4;
    const __m256i lo = keep(shift(bytes32(b + 64 * c + 32 * (g & 1)), -4 * (g >> 1)), 15);
    const __m256i hi = keep(shift(bytes32(b + 128 + 32 * c), 4 - 2 * g), 0x30);
    Vec f[kVecs];
    widen(_mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32)), f);
    for (int v = 0; v < kVecs; ++v) w[v] = mul(set1(s[8 * c + 2 * g + v * kLanes / 16]), f[v]);
  }
};

// IQ4_XS: 8 sub-blocks of 32, w = (d * (sc - 32)) * kIq4Values[q].
template <>
struct Rebuild<kIQ4_XS> {
  const uint8_t* b;
  alignas(32) float s[8];  // d * (scale - 32) of each sub-block

  explicit Rebuild(const uint8_t* blk) : b(blk) {
    // scale j: nibble j of scales_l (4 bytes from 4), and bits 2j, 2j + 1 of scales_h (2 bytes from 2) above
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i low =
        _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(u32(blk + 4))), _mm256_slli_epi32(lane, 2));
    const __m256i high = _mm256_srlv_epi32(_mm256_set1_epi32(blk[2] | (blk[3] << 8)), _mm256_add_epi32(lane, lane));
    const __m256i sc = _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi32(15)),
                                       _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(3)), 4));
    _mm256_store_ps(s, _mm256_mul_ps(_mm256_set1_ps(_mm_cvtss_f32(halves(blk))),
                                     _mm256_cvtepi32_ps(_mm256_sub_epi32(sc, _mm256_set1_epi32(32)))));
  }

  void sub(int j, Vec* w) const {
    const uint8_t* q = b + 8 + 16 * j;  // low nibbles: weights 0-15, high nibbles: 16-31
#if defined(__AVX512F__)
    const Vec table = _mm512_mul_ps(set1(s[j]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(kIq4Values))));
    const __m512i x = indices(q);
    w[0] = _mm512_permutexvar_ps(x, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), table);
#else
    Vec f[kVecs];
    widen(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(bytes16(kIq4Values)), nibbles(bytes16(q))), f);
    for (int v = 0; v < kVecs; ++v) w[v] = mul(set1(s[j]), f[v]);
#endif
  }
};

}  // namespace pagedserve::gguf::decode

#endif
