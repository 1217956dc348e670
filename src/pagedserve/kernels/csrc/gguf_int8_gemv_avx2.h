// gguf_int8_gemv.h's row kernel for the avx2 build (AVX2 + FMA + F16C, no VNNI): the k-quants (Q4_K, Q5_K,
// Q6_K), whose quants are below 64, so vpmaddubsw's pair sums fit int16, and the blocks of 32 of Q4_1 and Q8_0
// (add_blocks32). Included by gguf_int8_gemv.h only.
//
// A 32-byte load of a block's nibbles holds 64 weights in order (low nibbles the first 32, high nibbles the
// next 32; Q6_K's 32 bytes of ql the same with its high bits from qh), so x stays in its own order (run_at)
// and each vector of 32 weights is one sub-block of 32 (Q4_K, Q5_K) or two runs of 16 (Q6_K). Per group of 256
// weights of a row and per row of x, in integers:
//   isum = sum over the 8 vectors of vpmaddwd(vpmaddubsw(quants, x), the vector's int16 scales)
// (Q6_K: minus 32 * its scale per 16 times the sum of x over that 16), then one float multiply-add of
// isum * d * dx per group; Q4_K / Q5_K's mins (dmin * min per 32) times x's sums per 32 go into a second float
// accumulator, subtracted at the end. Against gguf_int8.h's driver at one row (a group rebuilt into memory,
// scales and offsets a scalar at a time, float32 offsets per 16), this keeps a row's work in registers.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "gguf_blocks.h"

namespace pagedserve::gguf::int8::gemv {

// The types of the row kernel below: the k-quants, whose quants are below 64 (vpmaddubsw's pair sums fit
// int16), Q4_1 (quants 0..15) and Q8_0 (signed quants: |q| times x with q's sign, as llama.cpp's AVX2 dot).
constexpr bool has_row_kernel(int64_t type, bool) {
  return type == kQ4_K || type == kQ5_K || type == kQ6_K || type == kQ4_1 || type == kQ8_0;
}

// Where x's run of 16 number j (of a group's 16) is stored within its group: x's own order.
template <int64_t T>
constexpr int64_t run_at(int j) {
  return 16 * j;
}

// Accumulators of one weight row times MR rows of x, one vector each (the 4 rows of weights streamed_rows
// takes side by side keep theirs in registers).
template <int MR>
struct Acc {
  __m256 q[MR];
  Acc() {
    for (int r = 0; r < MR; ++r) q[r] = _mm256_setzero_ps();
  }
  float sum(int r) const { return hsum(q[r]); }
};

// One weight row times the MR rows of x, a group at a time (for streamed_rows).
template <int64_t T, int MR, typename Out>
struct RowKernel {
  using Acc = gemv::Acc<MR>;
  // blocks of 32 (Q4_1, Q8_0): 8 of them per group of x
  static constexpr bool kBlocks32 = Format<T>::kElems == 32;
  static constexpr int64_t kGroupBytes = kBlocks32 ? 8 * Format<T>::kBytes : Format<T>::kBytes;
  const Args& a;

  // isum[r] += the vector's quants w . x's 32 values at xoff, times the int16 scales sc
  [[gnu::always_inline]] void dot(__m256i* isum, __m256i w, __m256i sc, int64_t xoff) const {
    for (int r = 0; r < MR; ++r) {
      const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.q + r * a.stride + xoff));
      isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), sc));
    }
  }

  [[gnu::always_inline]] void add(Acc& acc, int64_t n, int64_t g) const {
    const uint8_t* b = a.w + n * a.row_bytes + g * kGroupBytes;
    for (int64_t off = 0; off < kGroupBytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(b + kAhead + off), _MM_HINT_T0);
    const int64_t x0 = g * kGroup;
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256i isum[MR];
    for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
    if constexpr (kBlocks32) return add_blocks32(acc, b, g);
    float d;
    if constexpr (T == kQ4_K || T == kQ5_K) {
      const __m128i sm = k4_scales_mins(b);  // bytes 0..7: the sub-blocks' scales, 8..15: their mins
      // sub-block v's scale as int16 in every lane: byte v of sm, zero-extended, by one vpshufb of sm in both halves
      const __m256i sm2 = _mm256_broadcastsi128_si256(sm);
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u32(b))));  // d, dmin
      d = _mm_cvtss_f32(dm);
      const __m256 mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))),
                                        _mm256_broadcastss_ps(_mm_movehdup_ps(dm)));
      const uint8_t* qs = b + (T == kQ5_K ? 48 : 16);
      // Q5_K: the fifth bit of sub-block v's weight l is bit v of qh[l]
      [[maybe_unused]] const __m256i qh =
          T == kQ5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        for (int h = 0; h < 2; ++h) {
          const int v = 2 * c + h;
          __m256i w = _mm256_and_si256(h ? _mm256_srli_epi16(bytes, 4) : bytes, low4);
          if constexpr (T == kQ5_K)
            w = _mm256_or_si256(w, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, v), _mm256_set1_epi8(1)), 4));
          dot(isum, w, _mm256_shuffle_epi8(sm2, _mm256_set1_epi16(static_cast<int16_t>(0x8000 | v))), x0 + 32 * v);
        }
      }
      for (int r = 0; r < MR; ++r) {
        const __m256 sums = _mm256_cvtepi32_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sums + (r * a.groups + g) * kSums<T>)));
        acc.q[r] = _mm256_fnmadd_ps(_mm256_mul_ps(mins, _mm256_set1_ps(a.d[r * a.groups + g])), sums, acc.q[r]);
      }
    } else if constexpr (T == kQ6_K) {
      // weights 128 c + 32 j + l: ql[64 c + l] (j = 0) and ql[64 c + 32 + l] (j = 1) low nibbles, the same
      // bytes' high nibbles (j = 2, 3); high bits (qh[32 c + l] >> 2 j) & 3
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
      // the int16 scales of runs 0..7 in both halves, and of runs 8..15
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
      const __m256i halves[2] = {_mm256_permute2x128_si256(sc16, sc16, 0x00),
                                 _mm256_permute2x128_si256(sc16, sc16, 0x11)};
      d = f16(b + 208);
      const __m256i low2 = _mm256_set1_epi8(3);
      for (int c = 0; c < 2; ++c) {
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * c));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * c + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * c));
        for (int j = 0; j < 4; ++j) {
          const __m256i l = j % 2 ? l1 : l0;
          const __m256i nib = _mm256_and_si256(j < 2 ? l : _mm256_srli_epi16(l, 4), low4);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), low2);
          const int v = 4 * c + j;  // runs of 16 number 2 v (int16 lanes 0..7) and 2 v + 1 (8..15)
          const int i = (2 * v) % 8;  // int16 lane of run 2 v's scale in its half (bytes 2 i, 2 i + 1)
          const __m256i pick = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>((2 * i + 2) | (2 * i + 3) << 8)),
                                                _mm_set1_epi16(static_cast<int16_t>((2 * i) | (2 * i + 1) << 8)));
          dot(isum, _mm256_or_si256(nib, _mm256_slli_epi16(high, 4)), _mm256_shuffle_epi8(halves[v / 4], pick),
              x0 + 32 * v);
        }
      }
      // q - 32: minus 32 * scale * x's sum, per 16
      const __m256i sc_lo = _mm256_cvtepi8_epi32(sc8), sc_hi = _mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8));
      for (int r = 0; r < MR; ++r) {
        const int32_t* s = a.sums + (r * a.groups + g) * kSums<T>;
        const __m256i t = _mm256_add_epi32(
            _mm256_mullo_epi32(sc_lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s))),
            _mm256_mullo_epi32(sc_hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 8))));
        isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(t, 5));
      }
    }
    for (int r = 0; r < MR; ++r)
      acc.q[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * a.d[r * a.groups + g]), acc.q[r]);
  }

  // Q4_1 (w = d q + m), Q8_0 (w = d q): the group's blocks (fewer than 8 in a row's last group), each block's
  // 8 int32 lanes of q . x times its d into a float vector, times dx; Q4_1's m times x's sum per 32 beside it.
  [[gnu::always_inline]] void add_blocks32(Acc& acc, const uint8_t* b, int64_t g) const {
    constexpr int64_t B = Format<T>::kBytes;
    const int blocks = static_cast<int>(std::min<int64_t>(8, a.k / 32 - 8 * g));
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 f[MR];
    for (int r = 0; r < MR; ++r) f[r] = _mm256_setzero_ps();
    alignas(32) float m[8] = {};
    for (int j = 0; j < 8 && j < blocks; ++j) {
      const uint8_t* blk = b + j * B;
      const __m256 dj = _mm256_set1_ps(f16(blk));
      __m256i w, sign;
      if constexpr (T == kQ4_1) {
        m[j] = f16(blk + 2);
        // byte i: weight i (low nibble), weight i + 16 (high)
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
        w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low4);
      } else {
        sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        w = _mm256_sign_epi8(sign, sign);  // |q|
      }
      for (int r = 0; r < MR; ++r) {
        __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.q + r * a.stride + g * kGroup + 32 * j));
        if constexpr (T == kQ8_0) x = _mm256_sign_epi8(x, sign);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
        f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dj, f[r]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m256 dx = _mm256_set1_ps(a.d[r * a.groups + g]);
      acc.q[r] = _mm256_fmadd_ps(f[r], dx, acc.q[r]);
      if constexpr (T == kQ4_1) {
        const __m256 sums = _mm256_cvtepi32_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sums + (r * a.groups + g) * kSums<T>)));
        acc.q[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_load_ps(m), dx), sums, acc.q[r]);
      }
    }
  }

  [[gnu::always_inline]] void store(const Acc& acc, int64_t n) const {
    Out* y = static_cast<Out*>(a.y);
    for (int r = 0; r < MR; ++r) y[r * a.n + n] = static_cast<Out>(acc.sum(r) + (a.bias ? a.bias[n] : 0.f));
  }
};

template <int64_t T, typename Out>
[[gnu::noinline]] void rows_plain(const Args& a, int64_t n0, int64_t n1) {
  if constexpr (has_row_kernel(T, false)) {
    switch (a.m) {
      case 1: return streamed_rows(RowKernel<T, 1, Out>{a}, n0, n1, a.groups);
      case 2: return streamed_rows(RowKernel<T, 2, Out>{a}, n0, n1, a.groups);
      case 3: return streamed_rows(RowKernel<T, 3, Out>{a}, n0, n1, a.groups);
      default: return streamed_rows(RowKernel<T, 4, Out>{a}, n0, n1, a.groups);
    }
  }
}

}  // namespace pagedserve::gguf::int8::gemv
