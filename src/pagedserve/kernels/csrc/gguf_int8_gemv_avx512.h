// gguf_int8_gemv.h's row kernel for the avx512 / amx builds. Per group of 256 weights of a row:
//   - x's runs stored so that the rebuild never moves bytes across lanes (run_at);
//   - the weights go in as unsigned bytes, 4 products straight into int32 (vpdpbusd; vpmaddubsw + vpmaddwd
//     without VNNI, where the quants are below 64 so pair sums fit int16): the k-quants' quants as they are
//     (0..15, 0..31, 0..63), Q8_0's int8 quants xor 0x80, IQ4_XS's kIq4Values + 128 by one vpshufb;
//   - each int32 lane times its 32's (Q6_K: 16's) float scale into a float vector per group, times dx into one
//     accumulator per row of x;
//   - the offset (Q4_K / Q5_K: dmin * min per 32; Q8_0, IQ4_XS: 128 * scale per 32; Q6_K: 32 * scale per 16)
//     times the sum of x's quants over those 32 or 16 goes into a second one.
// Against an integer sum per group times its scales (the first form), the float scale per 32 read the cold
// weights of Llama-1B's shapes 1.2x faster on a Xeon core (Q4_K 12.4 -> 15.5 GB/s, one thread), at the same
// speed with the weights in cache. Included by gguf_int8_gemv.h only.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "gguf_blocks.h"

namespace pagedserve::gguf::int8::gemv {

// The types of the row kernel below: the k-quants (quants below 64, so vpmaddubsw's pair sums fit int16) and,
// with VNNI's vpdpbusd, Q8_0's and IQ4_XS's unsigned values.
constexpr bool has_row_kernel(int64_t type, bool vnni) {
  return type == kQ4_K || type == kQ5_K || type == kQ6_K || (vnni && (type == kQ8_0 || type == kIQ4_XS));
}

// Where x's run of 16 number j (of a group's 16) is stored within its group. Q4_K / Q5_K: a 64-byte load of
// nibbles holds weights 0..31 and 64..95 (low nibbles) and 32..63 and 96..127 (high nibbles) of its 128, so the
// runs of 32 go in the order 0 2 1 3 4 6 5 7. IQ4_XS: a 64-byte load holds sub-blocks 4h..4h+3 (one per 128-bit
// lane), low nibbles their weights 0..15, high nibbles 16..31. Q8_0, Q6_K: x's own order.
template <int64_t T>
constexpr int64_t run_at(int j) {
  if constexpr (T == kQ4_K || T == kQ5_K) {
    const int c = j / 2;
    return 32 * ((c & 4) | ((c & 1) << 1) | ((c >> 1) & 1)) + 16 * (j % 2);
  }
  return T == kIQ4_XS ? 64 * (2 * (j / 8) + j % 2) + 16 * ((j / 2) % 4) : 16 * j;
}

// A group of 256 weights rebuilt: nv vectors of 64 unsigned bytes and each int32 lane's scale, and what
// multiplies each sum of x's quants (subtracted): offset8 per 32, or offset16 per 16 (Q6_K).
struct Group {
  __m512i q[4];
  __m512 scale[4];
  __m256 offset8;
  __m512 offset16;
  int nv;
};

// Q8_0's 8 blocks of 32 at b (a whole group): their d as floats, from two vpermt2w over the 272 bytes.
[[gnu::always_inline]] inline __m256 q8_0_scales(const uint8_t* b) {
  alignas(64) static constexpr int16_t kAt[32] = {0, 17, 34, 51};  // int16 index of blocks 0..3's d (34 B apart)
  const __m512i idx = _mm512_load_si512(kAt);
  const __m512i lo = _mm512_permutex2var_epi16(_mm512_loadu_si512(b), idx, _mm512_loadu_si512(b + 64));
  const __m512i hi = _mm512_permutex2var_epi16(_mm512_loadu_si512(b + 136), idx, _mm512_loadu_si512(b + 200));
  return _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm512_castsi512_si128(lo), _mm512_castsi512_si128(hi)));
}

// lanes 0..7 scale a, 8..15 scale b (float vector of 8 values, picked by index)
[[gnu::always_inline]] inline __m512 spread(__m256 s8, int a, int b) {
  return _mm512_permutexvar_ps(_mm512_inserti64x4(_mm512_set1_epi32(a), _mm256_set1_epi32(b), 1),
                               _mm512_castps256_ps512(s8));
}

// Q8_0: blocks 8g .. of a row of nb blocks (fewer than 8 in a row's last group: the rest zero).
[[gnu::always_inline]] inline void rebuild_q8_0(const uint8_t* row, int64_t g, int64_t nb, Group& u) {
  constexpr int64_t B = 34;
  const uint8_t* b = row + 8 * g * B;
  const int64_t blocks = std::min<int64_t>(8, nb - 8 * g);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  u.nv = static_cast<int>((blocks + 1) / 2);
  if (blocks == 8) {
    const __m256 d = q8_0_scales(b);
    u.offset8 = _mm256_mul_ps(d, _mm256_set1_ps(128.f));
    for (int v = 0; v < 4; ++v) {
      const uint8_t* p = b + 2 * v * B + 2;
      u.q[v] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(p))), _mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(p + B)), 1), flip);
      u.scale[v] = spread(d, 2 * v, 2 * v + 1);
    }
    return;
  }
  for (int v = 0; v < u.nv; ++v) {
    const uint8_t* p = b + 2 * v * B;
    const bool pair = 2 * v + 1 < blocks;
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    const __m256i hi = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + B + 2)) : _mm256_set1_epi8(-128);
    u.q[v] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), flip);
    u.scale[v] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(f16(p)), _mm512_set1_ps(pair ? f16(p + B) : 0.f));
  }
  alignas(32) float d[8] = {};
  for (int j = 0; j < blocks; ++j) d[j] = f16(b + j * B);
  u.offset8 = _mm256_mul_ps(_mm256_load_ps(d), _mm256_set1_ps(128.f));
}

// IQ4_XS: block g (136 bytes).
[[gnu::always_inline]] inline void rebuild_iq4_xs(const uint8_t* row, int64_t g, Group& u) {
  const uint8_t* b = row + g * 136;
  const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(
      1, 24, 45, 63, 79, 93, 106, 118, static_cast<char>(129), static_cast<char>(141), static_cast<char>(153),
      static_cast<char>(166), static_cast<char>(181), static_cast<char>(197), static_cast<char>(217),
      static_cast<char>(241)));  // kIq4Values + 128
  // sub-block j's scale: 4 low bits at bit 4 j of scales_l, 2 high bits at bit 2 j of scales_h
  const __m256i low = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(u32(b + 4))),
                                                         _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                       _mm256_set1_epi32(15));
  const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(b[2] | (b[3] << 8)),
                                                          _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                        _mm256_set1_epi32(3));
  const __m256i scales = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
  const __m256 s8 = _mm256_mul_ps(_mm256_cvtepi32_ps(scales), _mm256_set1_ps(f16(b)));
  u.offset8 = _mm256_mul_ps(s8, _mm256_set1_ps(128.f));
  const __m512i low4 = _mm512_set1_epi8(15);
  u.nv = 4;
  for (int h = 0; h < 2; ++h) {
    const __m512i bytes = _mm512_loadu_si512(b + 8 + 64 * h);
    u.q[2 * h] = _mm512_shuffle_epi8(table, _mm512_and_si512(bytes, low4));
    u.q[2 * h + 1] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4));
    // 128-bit lane i: sub-block 4h + i
    u.scale[2 * h] = u.scale[2 * h + 1] = _mm512_permutexvar_ps(
        _mm512_setr_epi32(4 * h, 4 * h, 4 * h, 4 * h, 4 * h + 1, 4 * h + 1, 4 * h + 1, 4 * h + 1, 4 * h + 2,
                          4 * h + 2, 4 * h + 2, 4 * h + 2, 4 * h + 3, 4 * h + 3, 4 * h + 3, 4 * h + 3),
        _mm512_castps256_ps512(s8));
  }
}

// Q4_K / Q5_K: block g. A 64-byte load of nibbles holds runs 4h (low nibbles of bytes 0..31), 4h + 2 (low,
// 32..63), 4h + 1 and 4h + 3 (high nibbles); Q5_K adds each weight's fifth bit (16) from qh.
template <int64_t T>
[[gnu::always_inline]] inline void rebuild_k4(const uint8_t* row, int64_t g, Group& u) {
  const uint8_t* b = row + g * Format<T>::kBytes;
  const __m128i sm = k4_scales_mins(b);  // bytes 0..7: the runs' scales, 8..15: their mins
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u32(b))));
  const __m256 s8 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)), _mm256_broadcastss_ps(dm));
  u.offset8 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))),
                            _mm256_broadcastss_ps(_mm_movehdup_ps(dm)));
  const uint8_t* qs = b + (T == kQ5_K ? 48 : 16);
  const __m512i low4 = _mm512_set1_epi8(15);
  u.nv = 4;
  for (int h = 0; h < 2; ++h) {
    const __m512i bytes = _mm512_loadu_si512(qs + 64 * h);
    u.q[2 * h] = _mm512_and_si512(bytes, low4);
    u.q[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
    u.scale[2 * h] = spread(s8, 4 * h, 4 * h + 2);
    u.scale[2 * h + 1] = spread(s8, 4 * h + 1, 4 * h + 3);
  }
  if constexpr (T == kQ5_K) {
    // the fifth bit of weight 64 c + l is bit 2 c of qh[l], of weight 64 c + 32 + l bit 2 c + 1; vector
    // 2h + hi holds weights 128 h + 32 hi + l (bit 4h + hi) and 128 h + 64 + 32 hi + l (bit 4h + 2 + hi)
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
    const __m512i sixteen = _mm512_set1_epi8(16);
    for (int v = 0; v < 4; ++v) {
      const int bit = 4 * (v / 2) + (v % 2);
      const __m512i mask = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << bit)),
                                              _mm256_set1_epi8(static_cast<char>(1 << (bit + 2))), 1);
      u.q[v] = _mm512_mask_add_epi8(u.q[v], _mm512_test_epi8_mask(qh, mask), u.q[v], sixteen);
    }
  }
}

// Q6_K: block g (210 bytes), quants 0..63 in x's order; weights 128 c + 0..63: low nibbles of ql[64 c ..], high
// bits (qh[32 c + l] >> 0 / 2) & 3; weights 128 c + 64..127: high nibbles, high bits >> 4 / 6.
[[gnu::always_inline]] inline void rebuild_q6_k(const uint8_t* row, int64_t g, Group& u) {
  const uint8_t* b = row + g * 210;
  const __m512 s16 = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))),
      _mm512_set1_ps(f16(b + 208)));
  u.offset16 = _mm512_mul_ps(s16, _mm512_set1_ps(32.f));
  const __m512i low4 = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30);
  const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  u.nv = 4;
  for (int c = 0; c < 2; ++c) {
    const __m512i ql = _mm512_loadu_si512(b + 64 * c);
    const __m512i qh =
        _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * c)));
    // a | (b & c): 0xF8; the high bits land on bits 4..5
    u.q[2 * c] = _mm512_ternarylogic_epi32(_mm512_and_si512(ql, low4), _mm512_sllv_epi16(qh, shl), bits45, 0xF8);
    u.q[2 * c + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                               _mm512_srlv_epi16(qh, shr), bits45, 0xF8);
  }
  // vector v: runs of 16 number 4v..4v + 3, one per 4 int32 lanes
  for (int v = 0; v < 4; ++v)
    u.scale[v] = _mm512_permutexvar_ps(
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(16 * v)), 2), s16);
}

// Accumulators of one weight row times MR rows of x: dx * (scales . quant products) in float lanes, and the
// offsets per 32 in half as many (subtracted when summed).
template <int MR>
struct Acc {
  __m512 q[MR];
  __m256 off[MR];
  Acc() {
    for (int r = 0; r < MR; ++r) q[r] = _mm512_setzero_ps(), off[r] = _mm256_setzero_ps();
  }
  float sum(int r) const {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(off[r]), _mm256_extractf128_ps(off[r], 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm512_reduce_add_ps(q[r]) - _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
  }
};

// One weight row times the MR rows of x, a group at a time (for streamed_rows).
template <int64_t T, class Dot, int MR, typename Out>
struct RowKernel {
  using Acc = gemv::Acc<MR>;
  static constexpr int64_t kGroupBytes = T == kQ8_0 ? 8 * 34 : Format<T>::kBytes;
  const Args& a;
  [[gnu::always_inline]] void add(Acc& acc, int64_t n, int64_t g) const {
    const uint8_t* row = a.w + n * a.row_bytes;
    for (int64_t off = 0; off < kGroupBytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row + g * kGroupBytes + kAhead + off), _MM_HINT_T0);
    Group u;
    if constexpr (T == kQ8_0) rebuild_q8_0(row, g, a.k / 32, u);
    else if constexpr (T == kIQ4_XS) rebuild_iq4_xs(row, g, u);
    else if constexpr (T == kQ6_K) rebuild_q6_k(row, g, u);
    else rebuild_k4<T>(row, g, u);
    for (int r = 0; r < MR; ++r) {
      const int8_t* xq = a.q + r * a.stride + g * kGroup;
      __m512 f = _mm512_setzero_ps();
      for (int v = 0; v < u.nv; ++v) {
        const __m512i s = Dot::dot4(u.q[v], _mm512_loadu_si512(xq + 64 * v));
        f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), u.scale[v], f);
      }
      const float dx = a.d[r * a.groups + g];
      const int32_t* sums = a.sums + (r * a.groups + g) * kSums<T>;
      if constexpr (T == kQ6_K) {  // q - 32 per 16: into the same lanes
        f = _mm512_fnmadd_ps(u.offset16, _mm512_cvtepi32_ps(_mm512_loadu_si512(sums)), f);
      } else {
        const __m256i sum32 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums));
        acc.off[r] =
            _mm256_fmadd_ps(_mm256_mul_ps(u.offset8, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(sum32), acc.off[r]);
      }
      acc.q[r] = _mm512_fmadd_ps(f, _mm512_set1_ps(dx), acc.q[r]);
    }
  }
  [[gnu::always_inline]] void store(const Acc& acc, int64_t n) const {
    Out* y = static_cast<Out*>(a.y);
    for (int r = 0; r < MR; ++r) y[r * a.n + n] = static_cast<Out>(acc.sum(r) + (a.bias ? a.bias[n] : 0.f));
  }
};

template <int64_t T, class Dot, typename Out>
[[gnu::always_inline]] inline void rows_any(const Args& a, int64_t n0, int64_t n1) {
  switch (a.m) {
    case 1: return streamed_rows(RowKernel<T, Dot, 1, Out>{a}, n0, n1, a.groups);
    case 2: return streamed_rows(RowKernel<T, Dot, 2, Out>{a}, n0, n1, a.groups);
    case 3: return streamed_rows(RowKernel<T, Dot, 3, Out>{a}, n0, n1, a.groups);
    default: return streamed_rows(RowKernel<T, Dot, 4, Out>{a}, n0, n1, a.groups);
  }
}

template <int64_t T, typename Out>
[[gnu::noinline]] void rows_plain(const Args& a, int64_t n0, int64_t n1) {
  if constexpr (has_row_kernel(T, false)) rows_any<T, DotPlain, Out>(a, n0, n1);
}

template <int64_t T, typename Out>
[[gnu::noinline, gnu::target("avx512vnni")]] void rows_vnni(const Args& a, int64_t n0, int64_t n1) {
  if constexpr (has_row_kernel(T, true)) rows_any<T, DotVnni, Out>(a, n0, n1);
}

}  // namespace pagedserve::gguf::int8::gemv
