// gemm_gguf_int8 for 1 to kMaxRows rows of x (single-stream decode) on the types with a float scale per 32
// weights whose int8 form needs VNNI: Q8_0 (llama.cpp's q8_0 x q8_0 dot) and IQ4_XS; avx512 / amx builds on
// CPUs with avx512_vnni. gguf_int8_gemv.h's layout for the k-quants, with these types' arithmetic:
//   - x is quantized as gguf_int8.h does (the same int8 values and dx per 256), stored in the order the
//     weights come out of a block: Q8_0's is x's own; IQ4_XS's 64-byte load of nibbles holds sub-blocks 4h..4h+3
//     (one per 128-bit lane), its low nibbles their weights 0..15 and its high nibbles 16..31, so runs of 16
//     go to 64 (2h + half) + 16 i for sub-block 4h + i;
//   - the weights go in as unsigned bytes offset by 128 (Q8_0's int8 quants xor 0x80; IQ4_XS's kIq4Values +
//     128 by one vpshufb), 4 products straight into int32 by vpdpbusd;
//   - each lane times its 32's scale (Q8_0's d; IQ4_XS's d * (scale - 32)) into a float vector per group of
//     256, times dx into one accumulator per row of x; the offset, -128 times each 32's scale times the sum of
//     x's quants over those 32 (kept with x as int32), into a second one (8 lanes); both summed once per row.
// The integers are gguf_int8.h's, so results equal its own up to float32 rounding.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_int8_gemv.h"

namespace pagedserve::gguf::int8::gemv32 {

constexpr int64_t kMaxRows = 4, kLongRow = 4096, kAhead = 2048;

inline bool takes(int64_t type, int64_t m, bool vnni) {
  return vnni && m >= 1 && m <= kMaxRows && (type == kQ8_0 || type == kIQ4_XS);
}

// Where x's run of 16 number j (of a group's 16) is stored within its group.
template <int64_t T>
constexpr int64_t run_at(int j) {
  return T == kQ8_0 ? 16 * j : 64 * (2 * (j / 8) + j % 2) + 16 * ((j / 2) % 4);
}

// One row of k float32 values (k a multiple of 32) into int8 quants q, per group its dx and the sums of its
// quants per 32 in sub-block order (sums): the same quants as quantize_row.
template <int64_t T>
inline void quantize(const float* x, int64_t k, int8_t* q, float* d, int32_t* sums) {
  for (int64_t g = 0; g * kGroup < k; ++g) {
    const float* xg = x + g * kGroup;
    const int64_t len = std::min(kGroup, k - g * kGroup);
    const float top = abs_max(xg, len);
    const float inv = top > 0.f ? 127.f / top : 0.f;  // as quantize_row
    d[g] = top / 127.f;
    for (int j = 0; j < 16; ++j) {
      int8_t* at = q + g * kGroup + run_at<T>(j);
      const int32_t sum = 16 * j < len ? quantize16(xg + 16 * j, inv, at) : 0;
      if (16 * j >= len) std::memset(at, 0, 16);
      sums[8 * g + j / 2] = (j % 2 ? sums[8 * g + j / 2] : 0) + sum;
    }
  }
}

// A group of 256 weights rebuilt: nv vectors of 64 unsigned bytes (weights + 128) and each int32 lane's scale.
struct Group {
  __m512i q[4];
  __m512 scale[4];
  __m256 scale8;  // the 8 scales of its 32s
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
    const __m256 d = u.scale8 = q8_0_scales(b);
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
  u.scale8 = _mm256_load_ps(d);
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
  const __m256 s8 = u.scale8 = _mm256_mul_ps(_mm256_cvtepi32_ps(scales), _mm256_set1_ps(f16(b)));
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

struct Args {
  const int8_t* q;      // [m, stride]
  const int32_t* sums;  // [m, groups * 8]
  const float* d;       // [m, groups]
  int64_t stride, groups, m, k;
  const uint8_t* w;
  int64_t n, row_bytes;
  const float* bias;
  void* y;
};

// One weight row times the MR rows of x, a group at a time (for streamed_rows). gguf_int8_gemv.h's accumulators:
// the offsets go in times 128 (exact: a power of two), so its sum, q minus the offsets, is this type's.
template <int64_t T, int MR, typename Out>
struct RowKernel {
  using Acc = gemv::Acc<MR>;
  static constexpr int64_t kGroupBytes = T == kQ8_0 ? 8 * 34 : 136;
  const Args& a;
  [[gnu::always_inline]] void add(Acc& acc, int64_t n, int64_t g) const {
    const uint8_t* row = a.w + n * a.row_bytes;
    for (int64_t off = 0; off < kGroupBytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row + g * kGroupBytes + kAhead + off), _MM_HINT_T0);
    Group u;
    if constexpr (T == kQ8_0) rebuild_q8_0(row, g, a.k / 32, u);
    else rebuild_iq4_xs(row, g, u);
    for (int r = 0; r < MR; ++r) {
      const int8_t* xq = a.q + r * a.stride + g * kGroup;
      __m512 f = _mm512_setzero_ps();
      for (int v = 0; v < u.nv; ++v) {
        const __m512i s = DotVnni::dot4(u.q[v], _mm512_loadu_si512(xq + 64 * v));
        f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), u.scale[v], f);
      }
      const float dx = a.d[r * a.groups + g];
      const __m256i sum32 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sums + (r * a.groups + g) * 8));
      acc.q[r] = _mm512_fmadd_ps(f, _mm512_set1_ps(dx), acc.q[r]);
      acc.off[r] =
          _mm256_fmadd_ps(_mm256_mul_ps(u.scale8, _mm256_set1_ps(128.f * dx)), _mm256_cvtepi32_ps(sum32), acc.off[r]);
    }
  }
  [[gnu::always_inline]] void store(const Acc& acc, int64_t n) const {
    Out* y = static_cast<Out*>(a.y);
    for (int r = 0; r < MR; ++r) y[r * a.n + n] = static_cast<Out>(acc.sum(r) + (a.bias ? a.bias[n] : 0.f));
  }
};

// Weight rows n0 .. n1 - 1 times the MR rows of x.
template <int64_t T, int MR, typename Out>
[[gnu::noinline, gnu::target("avx512vnni")]] void rows(const Args& a, int64_t n0, int64_t n1) {
  streamed_rows(RowKernel<T, MR, Out>{a}, n0, n1, a.groups);
}

template <int64_t T, typename Out>
void rows_any(const Args& a, int64_t n0, int64_t n1) {
  switch (a.m) {
    case 1: return rows<T, 1, Out>(a, n0, n1);
    case 2: return rows<T, 2, Out>(a, n0, n1);
    case 3: return rows<T, 3, Out>(a, n0, n1);
    default: return rows<T, 4, Out>(a, n0, n1);
  }
}

// y [m, n] (float or bf16 as Out) = x^ W^T (+ bias) for m <= kMaxRows rows of x (float32 rows at x_stride, or
// bf16 when xb is given).
template <int64_t T, typename Out>
void gemm(const float* x, const c10::BFloat16* xb, int64_t x_stride, int64_t m, int64_t k, const uint8_t* w,
          int64_t n, int64_t row_bytes, const float* bias, void* y) {
  const int64_t groups = (k + kGroup - 1) / kGroup;
  const int64_t stride = groups * kGroup + 64;  // rows of x not a multiple of 4 KB apart (gguf_int8_gemv.h)
  std::vector<int8_t> q(m * stride + 64);
  int8_t* qp = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(q.data()) + 63) & ~uintptr_t{63});
  std::vector<int32_t> sums(m * groups * 8);
  std::vector<float> d(m * groups), widened(xb ? k : 0);
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * x_stride;
    if (xb) {
      for (int64_t j = 0; j < k; ++j) widened[j] = static_cast<float>(xb[r * x_stride + j]);
      row = widened.data();
    }
    quantize<T>(row, k, qp + r * stride, d.data() + r * groups, sums.data() + r * groups * 8);
  }
  // rows of many inputs: 2 rows of x per pass over the weights, as gguf_int8_gemv.h
  const int64_t per_pass = k > kLongRow ? 2 : m;
  for (int64_t m0 = 0; m0 < m; m0 += per_pass) {
    const Args a{qp + m0 * stride, sums.data() + m0 * groups * 8, d.data() + m0 * groups, stride, groups,
                 std::min(per_pass, m - m0), k, w, n, row_bytes, bias, static_cast<Out*>(y) + m0 * n};
    at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) { rows_any<T, Out>(a, n0, n1); });
  }
}

inline void run(int64_t type, const float* x, const c10::BFloat16* xb, int64_t x_stride, int64_t m, int64_t k,
                const uint8_t* w, int64_t n, int64_t row_bytes, const float* bias, void* y) {
  switch (type) {
    case kQ8_0: return xb ? gemm<kQ8_0, c10::BFloat16>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y)
                          : gemm<kQ8_0, float>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y);
    case kIQ4_XS: return xb ? gemm<kIQ4_XS, c10::BFloat16>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y)
                            : gemm<kIQ4_XS, float>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y);
    default: TORCH_CHECK(false, "gemm_gguf_int8: no few-row kernel for GGML type ", type);
  }
}

}  // namespace pagedserve::gguf::int8::gemv32
