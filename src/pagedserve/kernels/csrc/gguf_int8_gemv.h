// gemm_gguf_int8 for 1 to kMaxRows rows of x (single-stream decode) on the k-quants, avx512 / amx builds.
//
// Decode reads every weight once per token, so a row of x must cost less vector work per weight byte than
// the memory delivers (~18 GB/s per core here). gguf_int8.h's pass, built for up to 64 rows of x, spends more
// than that at one row (its accumulators live in an L1 buffer, its quants are regrouped into x's order, its
// offsets are float vectors per 16 weights): ~11 GB/s per core with the weights in L2, no faster than the
// float gemm_gguf. Here, per 256 weights of a row:
//   - x is quantized as gguf_int8.h does (the same int8 values and dx), but stored in the order the quants
//     lie in the block, so the rebuild never moves bytes across lanes: Q4_K / Q5_K's 64-byte load of nibbles
//     holds weights 0..31 and 64..95 (low nibbles) and 32..63 and 96..127 (high nibbles) of its 128, so each
//     group of x is stored with its runs of 32 in the order 0 2 1 3 4 6 5 7; Q6_K's order is x's own;
//   - the integer scales reach vpdpwssd as one vpermw each; the mins (Q4_K / Q5_K: dmin * min * sum of x per
//     32) and Q6_K's offset (-32 * d * scale * sum of x per 16) are integer dot products of the scales with
//     x's int16 sums per 16 (vpmaddwd), not float vectors;
//   - every accumulator stays in a register: per row of x one float vector for d * dx * (quants . x) and one
//     half vector for dmin * dx * (mins . sums), summed once per weight row;
//   - each thread reads its contiguous run of weight rows as kStreams runs side by side (gguf_blocks.h),
//     prefetching kAhead bytes ahead of its reads;
//   - rows of x of more than kLongRow inputs go 2 per pass over the weights (see gemm).
// The sums are the same integers as gguf_int8.h's, so the results equal its own up to float32 rounding.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"

namespace pagedserve::gguf::int8::gemv {

constexpr int64_t kMaxRows = 4, kLongRow = 4096;
// Bytes ahead of each read it prefetches. One thread read Llama-1B's shapes at about the same GB/s from 0 to 8 KB
// ahead on the EPYC, and from 0 to 16 KB ahead on the Xeon (one run or 4 side by side).
constexpr int64_t kAhead = 2048;

inline bool takes(int64_t type, int64_t m) {
  return m >= 1 && m <= kMaxRows && (type == kQ4_K || type == kQ5_K || type == kQ6_K);
}

// x quantized in the blocks' order: per row kpad int8 quants, per group of 256 its dx and 16 int16 sums of its
// runs of 16 (in x's own order).
struct X {
  const int8_t* q;
  const float* d;
  const int16_t* sums;
  int64_t kpad, groups;
};

// Position of x's run of 32 number c (of a group's 8) in the blocks' order: Q4_K / Q5_K swap the middle two
// of each half.
template <int64_t T>
constexpr int run_at(int c) {
  return T == kQ6_K ? c : (c & 4) | ((c & 1) << 1) | ((c >> 1) & 1);
}

// One row of k float32 values (k a multiple of 256) into q, d, sums: the same quants as quantize_row.
template <int64_t T>
inline void quantize(const float* x, int64_t k, int8_t* q, float* d, int16_t* sums) {
  for (int64_t g = 0; g * kGroup < k; ++g) {
    const float* xg = x + g * kGroup;
    const float top = abs_max(xg, kGroup);
    const float inv = top > 0.f ? 127.f / top : 0.f;  // as quantize_row
    d[g] = top / 127.f;
    for (int j = 0; j < 16; ++j)
      sums[g * 16 + j] = static_cast<int16_t>(
          quantize16(xg + 16 * j, inv, q + g * kGroup + 32 * run_at<T>(j / 2) + 16 * (j % 2)));
  }
}

// The weights of one block rebuilt: quants as unsigned bytes in the order x is stored, each int16 lane's
// scale, the scales or mins as int16 per 16 values of x (for vpmaddwd with x's sums), d and dmin.
struct Block {
  __m512i q[4], sc[4];
  __m256i offset16;
  float d, dmin;
};

// idx[v]: int16 lane l of quant vector v takes scale idx (a pair of weights in a run of 32 or 16)
template <int64_t T>
inline const __m512i* scale_indices() {
  static const __m512i* idx = [] {
    static __m512i out[4];
    for (int v = 0; v < 4; ++v) {
      alignas(64) int16_t lane[32];
      for (int l = 0; l < 32; ++l) {
        if (T == kQ6_K) {
          lane[l] = static_cast<int16_t>((64 * v + 2 * l) / 16);
        } else {  // vector v = 2h + hi holds runs 4h + hi (lanes 0..15) and 4h + 2 + hi (16..31)
          lane[l] = static_cast<int16_t>(4 * (v / 2) + (v % 2) + (l >= 16 ? 2 : 0));
        }
      }
      out[v] = _mm512_load_si512(lane);
    }
    return out;
  }();
  return idx;
}

template <int64_t T>
[[gnu::always_inline]] inline void rebuild(const uint8_t* b, const __m512i* idx, Block& u) {
  if constexpr (T == kQ4_K || T == kQ5_K) {
    const __m128i sm = k4_scales_mins(b);  // bytes 0..7: the runs' scales, 8..15: their mins
    const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(sm));
    for (int v = 0; v < 4; ++v) u.sc[v] = _mm512_permutexvar_epi16(idx[v], sc16);
    // min of run c for x's sums 2c and 2c + 1
    u.offset16 = _mm256_cvtepu8_epi16(
        _mm_shuffle_epi8(sm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u32(b))));
    u.d = _mm_cvtss_f32(dm), u.dmin = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    const uint8_t* qs = b + (T == kQ5_K ? 48 : 16);
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int h = 0; h < 2; ++h) {
      const __m512i bytes = _mm512_loadu_si512(qs + 64 * h);
      u.q[2 * h] = _mm512_and_si512(bytes, low4);
      u.q[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
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
  } else {  // Q6_K
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    for (int v = 0; v < 4; ++v) u.sc[v] = _mm512_permutexvar_epi16(idx[v], _mm512_castsi256_si512(sc16));
    u.offset16 = sc16;
    u.d = f16(b + 208), u.dmin = 0.f;
    // weights 128 c + 0..63: low nibbles of ql[64 c ..], high bits (qh[32 c + l] >> 0 / 2) & 3; weights
    // 128 c + 64..127: high nibbles, high bits >> 4 / 6; the high bits land on bits 4..5 (mask 0x30)
    const __m512i low4 = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30);
    const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int c = 0; c < 2; ++c) {
      const __m512i ql = _mm512_loadu_si512(b + 64 * c);
      const __m512i qh =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * c)));
      // a | (b & c): 0xF8
      u.q[2 * c] = _mm512_ternarylogic_epi32(_mm512_and_si512(ql, low4), _mm512_sllv_epi16(qh, shl), bits45, 0xF8);
      u.q[2 * c + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                                 _mm512_srlv_epi16(qh, shr), bits45, 0xF8);
    }
  }
}

struct Args {
  X x;
  int64_t m, k;
  const uint8_t* w;
  int64_t n, row_bytes;
  const float* bias;
  void* y;
};

inline void prefetch_block(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
}

// Accumulators of one weight row times MR rows of x: d * dx * (quants . x) in float lanes, and (Q4_K / Q5_K)
// dmin * dx * (mins . sums) in half as many.
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

// acc += block g of the weight row at `row` times the MR rows of x.
template <int64_t T, class Dot, int MR>
[[gnu::always_inline]] inline void add_block(const Args& a, const uint8_t* row, int64_t g, const __m512i* idx,
                                             Acc<MR>& acc) {
  constexpr int64_t B = Format<T>::kBytes;
  const uint8_t* b = row + g * B;
  prefetch_block(b + kAhead, B);
  Block u;
  rebuild<T>(b, idx, u);
  for (int r = 0; r < MR; ++r) {
    const int8_t* xq = a.x.q + r * a.x.kpad + g * kGroup;
    __m512i s = _mm512_setzero_si512();
    for (int v = 0; v < 4; ++v) s = Dot::dot(s, u.q[v], _mm512_loadu_si512(xq + 64 * v), u.sc[v]);
    const __m256i off = _mm256_madd_epi16(
        u.offset16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.x.sums + (r * a.x.groups + g) * 16)));
    const float dx = a.x.d[r * a.x.groups + g];
    if constexpr (T == kQ6_K) {  // q - 32: the same d
      s = _mm512_sub_epi32(s, _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5)));
    } else {
      acc.off[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(off), _mm256_set1_ps(u.dmin * dx), acc.off[r]);
    }
    acc.q[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(u.d * dx), acc.q[r]);
  }
}

// One weight row times the MR rows of x, a block at a time (for streamed_rows).
template <int64_t T, class Dot, int MR, typename Out>
struct RowKernel {
  using Acc = gemv::Acc<MR>;
  const Args& a;
  const __m512i* idx;
  [[gnu::always_inline]] void add(Acc& acc, int64_t n, int64_t g) const {
    add_block<T, Dot, MR>(a, a.w + n * a.row_bytes, g, idx, acc);
  }
  [[gnu::always_inline]] void store(const Acc& acc, int64_t n) const {
    Out* y = static_cast<Out*>(a.y);
    for (int r = 0; r < MR; ++r) y[r * a.n + n] = static_cast<Out>(acc.sum(r) + (a.bias ? a.bias[n] : 0.f));
  }
};

// Weight rows n0 .. n1 - 1 times the MR rows of x.
template <int64_t T, class Dot, int MR, typename Out>
[[gnu::always_inline]] inline void rows(const Args& a, int64_t n0, int64_t n1) {
  streamed_rows(RowKernel<T, Dot, MR, Out>{a, scale_indices<T>()}, n0, n1, a.k / kGroup);
}

template <int64_t T, class Dot, typename Out>
[[gnu::always_inline]] inline void rows_any(const Args& a, int64_t n0, int64_t n1) {
  switch (a.m) {
    case 1: return rows<T, Dot, 1, Out>(a, n0, n1);
    case 2: return rows<T, Dot, 2, Out>(a, n0, n1);
    case 3: return rows<T, Dot, 3, Out>(a, n0, n1);
    default: return rows<T, Dot, 4, Out>(a, n0, n1);
  }
}

template <int64_t T, typename Out>
[[gnu::noinline]] void rows_plain(const Args& a, int64_t n0, int64_t n1) {
  rows_any<T, DotPlain, Out>(a, n0, n1);
}

template <int64_t T, typename Out>
[[gnu::noinline, gnu::target("avx512vnni")]] void rows_vnni(const Args& a, int64_t n0, int64_t n1) {
  rows_any<T, DotVnni, Out>(a, n0, n1);
}

// y [m, n] (float or bf16 as Out) = x^ W^T (+ bias) for m <= kMaxRows rows of x (float32, rows at x_stride; or
// bf16 when xb is given).
template <int64_t T, typename Out>
void gemm(const float* x, const c10::BFloat16* xb, int64_t x_stride, int64_t m, int64_t k, const uint8_t* w,
          int64_t n, int64_t row_bytes, const float* bias, void* y, bool vnni) {
  const int64_t groups = k / kGroup;
  // rows of x 64 bytes further apart than k: at k = 8192 rows a multiple of 4 KB apart made 3-4 rows 2-3x slower
  const int64_t stride = k + 64;
  std::vector<int8_t> q(m * stride + 64);
  int8_t* qp = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(q.data()) + 63) & ~uintptr_t{63});
  std::vector<float> d(m * groups), widened(xb ? k : 0);
  std::vector<int16_t> sums(m * groups * 16);
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * x_stride;
    if (xb) {
      for (int64_t j = 0; j < k; ++j) widened[j] = static_cast<float>(xb[r * x_stride + j]);
      row = widened.data();
    }
    quantize<T>(row, k, qp + r * stride, d.data() + r * groups, sums.data() + r * groups * 16);
  }
  // Rows of more than kLongRow inputs take at most 2 rows of x per pass over the weights: with cold weights 3-4
  // rows of x of 8,192 inputs ran at a third of the GB/s of 2 (with the weights in L2 they do not slow down),
  // and two passes cost less than one.
  const int64_t per_pass = k > kLongRow ? 2 : m;
  for (int64_t m0 = 0; m0 < m; m0 += per_pass) {
    const Args a{{qp + m0 * stride, d.data() + m0 * groups, sums.data() + m0 * groups * 16, stride, groups},
                 std::min(per_pass, m - m0), k, w, n, row_bytes, bias, static_cast<Out*>(y) + m0 * n};
    // threads take contiguous runs of weight rows (at least 16 rows each)
    at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
      if (vnni) rows_vnni<T, Out>(a, n0, n1);
      else rows_plain<T, Out>(a, n0, n1);
    });
  }
}

inline void run(int64_t type, const float* x, const c10::BFloat16* xb, int64_t x_stride, int64_t m, int64_t k,
                const uint8_t* w, int64_t n, int64_t row_bytes, const float* bias, void* y, bool vnni) {
  switch (type) {
    case kQ4_K: return xb ? gemm<kQ4_K, c10::BFloat16>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y, vnni)
                          : gemm<kQ4_K, float>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y, vnni);
    case kQ5_K: return xb ? gemm<kQ5_K, c10::BFloat16>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y, vnni)
                          : gemm<kQ5_K, float>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y, vnni);
    case kQ6_K: return xb ? gemm<kQ6_K, c10::BFloat16>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y, vnni)
                          : gemm<kQ6_K, float>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y, vnni);
    default: TORCH_CHECK(false, "gemm_gguf_int8: no few-row kernel for GGML type ", type);
  }
}

}  // namespace pagedserve::gguf::int8::gemv
