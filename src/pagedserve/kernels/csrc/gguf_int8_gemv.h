// gemm_gguf_int8 for 1 to kMaxRows rows of x (single-stream decode): the k-quants (Q4_K, Q5_K, Q6_K) in the
// avx2, avx512 and amx builds and, on CPUs with AVX512-VNNI, Q8_0 (llama.cpp's q8_0 x q8_0 dot) and IQ4_XS.
//
// Decode reads every weight once per token, so a row of x must cost less vector work per weight byte than the
// memory delivers. gguf_int8.h's pass, built for up to 64 rows of x, spends more than that at one row. Here:
//   - x is quantized as gguf_int8.h does (the same int8 values and dx per 256), stored in the order the weights
//     come out of a block in this build's vectors (run_at), with the sums of its quants per 32 (Q6_K: per 16);
//   - each thread reads its contiguous run of weight rows as kStreams runs side by side (gguf_blocks.h),
//     prefetching kAhead bytes ahead of its reads, and multiplies each group of 256 weights, rebuilt in
//     registers, into every row of x (RowKernel: gguf_int8_gemv_avx512.h with 64-byte vectors and a float scale
//     per 32, gguf_int8_gemv_avx2.h with 32-byte vectors and integer scales);
//   - rows of x of more than kLongRow inputs go 2 per pass over the weights (see gemm).
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
#include "gguf_int8.h"

namespace pagedserve::gguf::int8::gemv {

constexpr int64_t kMaxRows = 4, kLongRow = 4096;
// Bytes ahead of each read it prefetches. One thread read Llama-1B's shapes at about the same GB/s from 0 to 8 KB
// ahead on the EPYC, and from 0 to 16 KB ahead on the Xeon (one run or 4 side by side).
constexpr int64_t kAhead = 2048;

// Sums of x's quants kept per group: per 16 for Q6_K (its scales' runs), else per 32.
template <int64_t T>
constexpr int kSums = T == kQ6_K ? 16 : 8;

struct Args {
  const int8_t* q;      // [m, stride]
  const int32_t* sums;  // [m, groups * kSums]
  const float* d;       // [m, groups]
  int64_t stride, groups, m, k;
  const uint8_t* w;
  int64_t n, row_bytes;
  const float* bias;
  void* y;
};

}  // namespace pagedserve::gguf::int8::gemv

// The row kernel (run_at, RowKernel, rows_plain and, with VNNI, rows_vnni) of this build's vectors.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "gguf_int8_gemv_avx512.h"
#else
#include "gguf_int8_gemv_avx2.h"
#endif

namespace pagedserve::gguf::int8::gemv {

// Whether m rows of x of this type take the few-row kernel (has_row_kernel: the ISA header's types).
inline bool takes(int64_t type, int64_t m, bool vnni) {
  return m >= 1 && m <= kMaxRows && has_row_kernel(type, vnni);
}

// One row of k float32 values (k a multiple of 32) into int8 quants q, per group its dx and the sums of its
// quants per 256 / kSums in x's order (sums): the same quants as quantize_row.
template <int64_t T>
inline void quantize(const float* x, int64_t k, int8_t* q, float* d, int32_t* sums) {
  constexpr int per = 16 / kSums<T>;  // runs of 16 per sum
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
      int32_t& s = sums[kSums<T> * g + j / per];
      s = (j % per ? s : 0) + sum;
    }
  }
}

// y [m, n] (float or bf16 as Out) = x^ W^T (+ bias) for m <= kMaxRows rows of x (float32 rows at x_stride, or
// bf16 when xb is given).
template <int64_t T, typename Out>
void gemm(const float* x, const c10::BFloat16* xb, int64_t x_stride, int64_t m, int64_t k, const uint8_t* w,
          int64_t n, int64_t row_bytes, const float* bias, void* y, bool vnni) {
  TORCH_CHECK(has_row_kernel(T, vnni), "gemm_gguf_int8: GGML type ", T, " has no few-row kernel in this build",
              vnni ? "" : " without AVX512-VNNI");
  const int64_t groups = (k + kGroup - 1) / kGroup;
  // rows of x 64 bytes further apart than k: at k = 8192 rows a multiple of 4 KB apart made 3-4 rows 2-3x slower
  const int64_t stride = groups * kGroup + 64;
  std::vector<int8_t> q(m * stride + 64);
  int8_t* qp = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(q.data()) + 63) & ~uintptr_t{63});
  std::vector<int32_t> sums(m * groups * kSums<T>);
  std::vector<float> d(m * groups), widened(xb ? k : 0);
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * x_stride;
    if (xb) {
      for (int64_t j = 0; j < k; ++j) widened[j] = static_cast<float>(xb[r * x_stride + j]);
      row = widened.data();
    }
    quantize<T>(row, k, qp + r * stride, d.data() + r * groups, sums.data() + r * groups * kSums<T>);
  }
  // Rows of more than kLongRow inputs take at most 2 rows of x per pass over the weights: with cold weights 3-4
  // rows of x of 8,192 inputs ran at a third of the GB/s of 2 (with the weights in L2 they do not slow down),
  // and two passes cost less than one.
  const int64_t per_pass = k > kLongRow ? 2 : m;
  for (int64_t m0 = 0; m0 < m; m0 += per_pass) {
    const Args a{qp + m0 * stride, sums.data() + m0 * groups * kSums<T>, d.data() + m0 * groups, stride, groups,
                 std::min(per_pass, m - m0), k, w, n, row_bytes, bias, static_cast<Out*>(y) + m0 * n};
    // threads take contiguous runs of weight rows (at least 16 rows each)
    at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
#if defined(PAGEDSERVE_GGUF_INT8_VNNI)
      if (vnni) return rows_vnni<T, Out>(a, n0, n1);
#endif
      rows_plain<T, Out>(a, n0, n1);
    });
  }
}

template <int64_t T>
void gemm_any(const float* x, const c10::BFloat16* xb, int64_t x_stride, int64_t m, int64_t k, const uint8_t* w,
              int64_t n, int64_t row_bytes, const float* bias, void* y, bool vnni) {
  if (xb) gemm<T, c10::BFloat16>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y, vnni);
  else gemm<T, float>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y, vnni);
}

inline void run(int64_t type, const float* x, const c10::BFloat16* xb, int64_t x_stride, int64_t m, int64_t k,
                const uint8_t* w, int64_t n, int64_t row_bytes, const float* bias, void* y, bool vnni) {
  switch (type) {
    case kQ4_1: return gemm_any<kQ4_1>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y, vnni);
    case kQ4_K: return gemm_any<kQ4_K>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y, vnni);
    case kQ5_K: return gemm_any<kQ5_K>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y, vnni);
    case kQ6_K: return gemm_any<kQ6_K>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y, vnni);
    case kQ8_0: return gemm_any<kQ8_0>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y, vnni);
    case kIQ4_XS: return gemm_any<kIQ4_XS>(x, xb, x_stride, m, k, w, n, row_bytes, bias, y, vnni);
    default: TORCH_CHECK(false, "gemm_gguf_int8: no few-row kernel for GGML type ", type);
  }
}

}  // namespace pagedserve::gguf::int8::gemv
