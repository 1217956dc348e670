// Block GEMM with int8 activations for a few rows of x (batched decode), where the float kernels of
// gguf_decode.h are bound by their float32 FMAs rather than by reading the weights. As llama.cpp does, each
// row of x is quantized to int8 in groups of 256 values (one float scale dx per group, the nearest integer
// of x / dx with dx = max|x| / 127), and the weights' integer quants, as unsigned bytes, are multiplied into
// it with integer dot products:
//   - k-quants (Q4_K, Q5_K, Q6_K: integer scales per 16 or 32 weights under one d per 256): vpmaddubsw
//     (quants 0..63 times x, pairs summed into int16: at most 2 * 63 * 127, never saturates), then
//     vpdpwssd (AVX512-VNNI) or vpmaddwd + vpaddd: times the sub-block's integer scale into int32 lanes over
//     the whole block, and one float multiply-add per block by d * dx;
//   - blocks of 32 with a float d each (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; IQ4_XS's sub-blocks of 32, d times
//     their 6-bit scale): vpdpbusd (VNNI; else vpmaddubsw + vpmaddwd by ones) into int32 lanes, 8 per block,
//     each scaled by its block's d in float; Q8_0's signed quants and IQ4_XS's values (kIq4Values[nibble],
//     looked up by vpshufb) go in offset by 128 (unsigned), whose pair sums would saturate vpmaddubsw: VNNI only;
//   - every type's offset (the weight of quant 0: Q4_K / Q5_K's - dmin * min, Q6_K's - 32 * d * scale,
//     Q4_0's - 8 d, Q4_1's m, Q8_0's and IQ4_XS's - 128 d, ...) times the sum of x over the same 16 values: one float
//     multiply-add of 16 lanes per 256 weights; x's sums per 16 come with its quants (dx * sum of quants).
// So y = sum over blocks of w . x^ exactly in integers, where x^ = dx * round(x / dx), up to float32
// rounding of a few products per block: against float x the error is at most sum_k |w_k| dx / 2.
//
// The weights of kPair rows are rebuilt once per 256 into registers (quants as bytes in the order of x,
// scales as int16 or float vectors, offsets as floats) and multiplied into every row of x (at most kMaxRows
// per pass, the float accumulators of a pass in a small buffer in L1). The vector code lives in
// gguf_int8_avx512.h (avx512 / amx builds: 64-byte vectors, both dot products compiled, VNNI's under a
// function target attribute, taken where the CPU has avx512_vnni) and gguf_int8_avx2.h (avx2: 32-byte
// vectors, vpmaddubsw + vpmaddwd; no Q8_0); this file holds what they share. The baseline build defines no
// int8 kernel: gguf_int8_types() is empty there and the dispatcher (model/layers/gguf_quant.py) keeps the
// float paths.
#pragma once

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
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
constexpr bool kFloatScales = T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1 || T == kQ8_0 || T == kIQ4_XS;
// Q8_0's quants and IQ4_XS's values, offset by 128 to unsigned bytes, reach 255 and 241: their pair sums
// saturate vpmaddubsw's int16, so they need VNNI's vpdpbusd (4 products straight into int32): avx512 builds on
// CPUs with avx512_vnni only.
template <int64_t T>
constexpr bool kSupported = kIntScales<T> || kFloatScales<T>;
template <int64_t T>
constexpr bool kNeedsVnni = T == kQ8_0 || T == kIQ4_XS;

// x as int8: rows of kpad (K rounded up to whole groups, zero padded) quants, per group its scale and the
// scaled sums of its 16-value runs.
struct Quantized {
  const int8_t* q;    // [m, kpad]
  const float* d;     // [m, groups]
  const float* s16;   // [m, groups * 16]
  int64_t kpad, groups;
};

// A 256-weight group of one weight row, rebuilt (Block in the ISA headers): quants as unsigned bytes in x's
// order (Vecs vectors), the int16 scale of each vpmaddubsw lane (a pair of weights), the offsets per 16
// weights and d.
template <class IVec, class FVec, int Vecs, int OffsetVecs>
struct Rebuilt {
  IVec q[Vecs];
  IVec sc[Vecs];     // kIntScales: each int16 lane's scale
  FVec scale[Vecs];  // kFloatScales: each int32 lane's d (8 lanes per block of 32)
  FVec offsets[OffsetVecs];
  FVec d;            // kIntScales
};

// A Q4_K / Q5_K block's 8 six-bit scales and mins (ggml's get_scale_min_k4, 4 bytes at a time): bytes 0..7 the
// scales of sub-blocks 0..7, bytes 8..15 their mins.
inline __m128i k4_scales_mins(const uint8_t* b) {
  uint32_t s[4];
  std::memcpy(s, b + 4, 12);
  constexpr uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  s[3] = ((s[2] >> 4) & m4) | (((s[1] >> 6) & m2) << 4);
  const uint32_t mins_lo = s[1] & m6;
  s[1] = (s[2] & m4) | (((s[0] >> 6) & m2) << 4);
  s[2] = mins_lo;
  s[0] &= m6;
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
}

}  // namespace pagedserve::gguf::int8

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "gguf_int8_avx512.h"
#else
#include "gguf_int8_avx2.h"
#endif

namespace pagedserve::gguf::int8 {

// One row of k float32 values (k a multiple of 32) into q, d and s16 as Quantized lays them out.
inline void quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* s16) {
  for (int64_t g = 0; g * kGroup < k; ++g) {
    const float* xg = x + g * kGroup;
    const int64_t len = std::min(kGroup, k - g * kGroup);
    const float top = abs_max(xg, len);
    const float inv = top > 0.f ? 127.f / top : 0.f;  // the tests emulate this rounding
    d[g] = top / 127.f;
    for (int64_t j = 0; j < kGroup; j += 16) {
      if (j < len) {
        s16[g * 16 + j / 16] = d[g] * static_cast<float>(quantize16(xg + j, inv, q + g * kGroup + j));
      } else {  // padding of the last group: zero quants, zero sums
        std::memset(q + g * kGroup + j, 0, 16);
        s16[g * 16 + j / 16] = 0.f;
      }
    }
  }
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
      q = _mm256_or_si256(q, _mm256_and_si256(bit_bytes(u32(b + (T == kQ5_0 ? 2 : 4))), _mm256_set1_epi8(16)));
    return q;
  }
}

// IQ4_XS's sub-block j of 32 (16 bytes of nibbles: values 0..15 low, 16..31 high) as unsigned bytes
// kIq4Values[nibble] + 128 (one vpshufb), its d * (scale - 32) and offset -128 times that.
inline __m256i iq4xs_sub_block(const uint8_t* b, int j, float d, float& dj, float& offset) {
  const __m128i table = _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, static_cast<char>(129),
                                      static_cast<char>(141), static_cast<char>(153), static_cast<char>(166),
                                      static_cast<char>(181), static_cast<char>(197), static_cast<char>(217),
                                      static_cast<char>(241));  // kIq4Values + 128
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8 + 16 * j)), low4 = _mm_set1_epi8(15);
  const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), _mm_and_si128(bytes, low4));
  dj = d * static_cast<float>(iq4xs_scale(j, b));
  offset = -128.f * dj;
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), idx);
}

// Group g of 256 weights (8 blocks of 32, fewer in a row's last group: the rest zero; IQ4_XS: block g's 8
// sub-blocks) from row `row` of nb blocks.
template <int64_t T>
inline void rebuild_small(const uint8_t* row, int64_t g, int64_t nb, Block& u) {
  constexpr int64_t B = Format<T>::kBytes;
  alignas(64) float d[8], offsets[16];
  __m256i q[8];
  const float iq4_d = T == kIQ4_XS ? f16(row + g * B) : 0.f;
  for (int j = 0; j < 8; ++j) {
    if constexpr (T == kIQ4_XS) {
      q[j] = iq4xs_sub_block(row + g * B, j, iq4_d, d[j], offsets[2 * j]);
    } else if (8 * g + j < nb) {
      q[j] = small_block<T>(row + (8 * g + j) * B, d[j], offsets[2 * j]);
    } else {
      q[j] = _mm256_setzero_si256(), d[j] = 0.f, offsets[2 * j] = 0.f;
    }
    offsets[2 * j + 1] = offsets[2 * j];
  }
  set_small(q, d, u);
  for (int o = 0; o < kOffsetVecs; ++o) u.offsets[o] = fload(offsets + o * kLanes);
}

struct Args {
  Quantized x;
  int64_t m, k;
  const uint8_t* w;  // [n, row_bytes]
  int64_t n, row_bytes;
  const float* bias;  // [n] or null
  void* y;            // [m, n] float or c10::BFloat16
};

// Weight rows n0, n0 + step, ... (R of them) times rows m0 .. m0 + rows - 1 of x, into acc[R][rows][kLanes].
template <int64_t T, class Dot, int R>
[[gnu::always_inline]] inline void pass(const Args& a, int64_t n0, int64_t step, int64_t m0, int64_t rows,
                                        float* acc) {
  constexpr int64_t B = Format<T>::kBytes, E = Format<T>::kElems;
  const uint8_t* w = a.w + n0 * a.row_bytes;
  for (int64_t b = 0; b < a.x.groups; ++b) {
    Block u[R];
    const int64_t at = b * kGroup / E * B, bytes = kGroup / E * B;  // group b's bytes in a row
    for (int i = 0; i < R; ++i) {
      const uint8_t* row = w + i * step * a.row_bytes;
      for (int64_t off = 0; off < bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + at + 1024 + off), _MM_HINT_T0);
      if constexpr (kIntScales<T>) rebuild<T>(row + at, u[i]);
      else rebuild_small<T>(row, b, a.k / E, u[i]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = m0 + r;
      const int8_t* xq = a.x.q + row * a.x.kpad + b * kGroup;
      IVec xv[kVecs];
      for (int v = 0; v < kVecs; ++v) xv[v] = iload(xq + kBytes * v);
      const float* s16 = a.x.s16 + (row * a.x.groups + b) * 16;
      const FVec dx = fset1(a.x.d[row * a.x.groups + b]);
      for (int i = 0; i < R; ++i) {
        float* out = acc + (i * rows + r) * kLanes;
        FVec sum;
        if constexpr (kIntScales<T>) {
          IVec s = izero();
          for (int v = 0; v < kVecs; ++v) s = Dot::dot(s, u[i].q[v], xv[v], u[i].sc[v]);
          sum = fmadd(cvt(s), fmul(u[i].d, dx), fload(out));
        } else {
          FVec f = fmul(cvt(Dot::dot4(u[i].q[0], xv[0])), u[i].scale[0]);
          for (int v = 1; v < kVecs; ++v) f = fmadd(cvt(Dot::dot4(u[i].q[v], xv[v])), u[i].scale[v], f);
          sum = fmadd(f, dx, fload(out));
        }
        for (int o = 0; o < kOffsetVecs; ++o) sum = fmadd(u[i].offsets[o], fload(s16 + o * kLanes), sum);
        fstore(out, sum);
      }
    }
  }
}

template <int64_t T, class Dot, int R, typename Out>
[[gnu::always_inline]] inline void tile(const Args& a, int64_t n0, int64_t step) {
  alignas(64) float acc[R * kMaxRows * kLanes];
  for (int64_t m0 = 0; m0 < a.m; m0 += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, a.m - m0);
    std::memset(acc, 0, sizeof(float) * R * rows * kLanes);
    pass<T, Dot, R>(a, n0, step, m0, rows, acc);
    for (int64_t r = 0; r < rows; ++r) {
      Out* y = static_cast<Out*>(a.y) + (m0 + r) * a.n + n0;
      for (int i = 0; i < R; ++i)
        y[i * step] =
            static_cast<Out>(hsum(fload(acc + (i * rows + r) * kLanes)) + (a.bias ? a.bias[n0 + i * step] : 0.f));
    }
  }
}

// Weight rows n0 .. n1 - 1: kPair at a time (the rebuilt blocks of both stay in registers), h rows apart
// (h = (n1 - n0) / kPair: the pairs read two far-apart runs side by side, see gguf_blocks.h's streamed_rows;
// Xeon, Llama-1B shapes, 8 rows of x, weights cold: ~1.2x the GB/s of adjacent pairs), then the rest one by one.
template <int64_t T, class Dot, typename Out>
[[gnu::always_inline]] inline void rows(const Args& a, int64_t n0, int64_t n1) {
  const int64_t h = (n1 - n0) / kPair;
  for (int64_t i = 0; i < h; ++i) tile<T, Dot, kPair, Out>(a, n0 + i, h);
  for (int64_t n = n0 + kPair * h; n < n1; ++n) tile<T, Dot, 1, Out>(a, n, 1);
}

template <int64_t T, typename Out>
[[gnu::noinline]] void rows_plain(const Args& a, int64_t n0, int64_t n1) {
  rows<T, DotPlain, Out>(a, n0, n1);
}

#if defined(PAGEDSERVE_GGUF_INT8_VNNI)
template <int64_t T, typename Out>
[[gnu::noinline, gnu::target("avx512vnni")]] void rows_vnni(const Args& a, int64_t n0, int64_t n1) {
  rows<T, DotVnni, Out>(a, n0, n1);
}
#endif

// The types gemm runs with VNNI's dot products (vnni) or without.
inline std::vector<int64_t> types(bool vnni) {
  std::vector<int64_t> out{kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K};
  if (vnni) out.insert(out.end(), {kQ8_0, kIQ4_XS});
  return out;
}

template <int64_t T, typename Out>
void gemm(const Args& a, bool vnni) {
  if constexpr (kSupported<T>) {
    TORCH_CHECK(vnni || !kNeedsVnni<T>, "gemm_gguf_int8: GGML type ", T, " needs AVX512-VNNI");
    // threads split the weight rows in pairs; every thread reads all of x (a few KB per row, in L2)
    at::parallel_for(0, (a.n + 1) / 2, 8, [&](int64_t p0, int64_t p1) {
      const int64_t n0 = 2 * p0, n1 = std::min(2 * p1, a.n);
#if defined(PAGEDSERVE_GGUF_INT8_VNNI)
      if (vnni || kNeedsVnni<T>) return rows_vnni<T, Out>(a, n0, n1);
#endif
      if constexpr (!kNeedsVnni<T>) rows_plain<T, Out>(a, n0, n1);
    });
  }
}

}  // namespace pagedserve::gguf::int8

#endif
