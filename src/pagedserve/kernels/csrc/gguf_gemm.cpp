// float32 matmul and dequantization over weights kept as the raw GGUF blocks of the file (gguf_blocks.h).
//
//   gemm_gguf(x [M, K] f32 or bf16, w [N, row_bytes] u8, type, bias?) -> y [M, N] = x W^T (+ bias), x's dtype
//   dequant_gguf(w [N, row_bytes] u8, type) -> W [N, K] f32
//
// gemm_gguf is the decode path (a few rows of x): bound by reading the weights. Every type takes the
// hand-vectorized kernel of gguf_decode.h in the avx2 / avx512 / amx builds; the baseline build rebuilds
// each weight block once into a small float buffer and multiplies it into up to 8 rows of x while it sits
// in L1. bf16 x is widened to float32 once per call into a plain buffer (not a
// tensor conversion: ~3 us less per call; the sums are float32 either way) and y is rounded to bf16 once.
// Larger batches are compute-bound; the caller dequantizes tiles of W with dequant_gguf into a scratch
// buffer and hands them to torch's GEMM (pagedserve/model/layers/gguf_quant.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "checks.h"
#include "gguf_blocks.h"
#include "gguf_decode.h"
#include "ops_library.h"

namespace {

using namespace pagedserve::gguf;

struct GgufArgs {
  const float* x;
  int64_t x_stride, k;
  const uint8_t* w;
  int64_t row_bytes;
  const float* bias;
  float* y;
  int64_t y_stride;
};

template <int64_t T, int MR>
void gguf_rows_out(const GgufArgs& a, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int64_t E = Format<T>::kElems, B = Format<T>::kBytes;
  const int64_t nb = a.k / E;
  alignas(64) float w[E];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * a.row_bytes;
    float out[MR];
    for (int r = 0; r < MR; ++r) out[r] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      dequant_block<T>(row + b * B, w);
      for (int r = 0; r < MR; ++r) {
        const float* xr = a.x + (m0 + r) * a.x_stride + b * E;
        float s = 0.f;
#pragma omp simd reduction(+ : s) aligned(w : 64)
        for (int64_t j = 0; j < E; ++j) s += w[j] * xr[j];
        out[r] += s;
      }
    }
    for (int r = 0; r < MR; ++r) a.y[(m0 + r) * a.y_stride + n] = out[r] + (a.bias ? a.bias[n] : 0.f);
  }
}

template <int64_t T>
void gguf_gemm_typed(const GgufArgs& a, int64_t m, int64_t n) {
  // Threads split the output features; every thread reads only its own weight rows.
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t c0 = n0; c0 < n1; c0 += 8) {  // 8 weight rows stay in L1 across the passes over x
      const int64_t c1 = std::min(c0 + 8, n1);
      for (int64_t m0 = 0; m0 < m;) {
        const int64_t left = m - m0;
        if (left >= 8) gguf_rows_out<T, 8>(a, m0, c0, c1), m0 += 8;
        else if (left >= 4) gguf_rows_out<T, 4>(a, m0, c0, c1), m0 += 4;
        else if (left >= 2) gguf_rows_out<T, 2>(a, m0, c0, c1), m0 += 2;
        else gguf_rows_out<T, 1>(a, m0, c0, c1), m0 += 1;
      }
    }
  });
}

template <int64_t T>
void gguf_dequant_typed(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t k, float* out) {
  constexpr int64_t E = Format<T>::kElems, B = Format<T>::kBytes;
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r)
      for (int64_t b = 0; b < k / E; ++b) dequant_block<T>(w + r * row_bytes + b * B, out + r * k + b * E);
  });
}

#define PAGEDSERVE_GGUF_DISPATCH(type, FN, ...)                             \
  switch (type) {                                                         \
    case kQ4_0: FN<kQ4_0>(__VA_ARGS__); break;                            \
    case kQ4_1: FN<kQ4_1>(__VA_ARGS__); break;                            \
    case kQ5_0: FN<kQ5_0>(__VA_ARGS__); break;                            \
    case kQ5_1: FN<kQ5_1>(__VA_ARGS__); break;                            \
    case kQ8_0: FN<kQ8_0>(__VA_ARGS__); break;                            \
    case kQ4_K: FN<kQ4_K>(__VA_ARGS__); break;                            \
    case kQ5_K: FN<kQ5_K>(__VA_ARGS__); break;                            \
    case kQ6_K: FN<kQ6_K>(__VA_ARGS__); break;                            \
    case kIQ4_XS: FN<kIQ4_XS>(__VA_ARGS__); break;                        \
    default: TORCH_CHECK(false, "unsupported GGUF type ", type);           \
  }

#if defined(PAGEDSERVE_GGUF_DECODE)
template <int64_t T>
void decode_typed(const decode::Args& a, int64_t m, bool bf16_out) {
  bf16_out ? decode::gemm<T, c10::BFloat16>(a, m) : decode::gemm<T, float>(a, m);
}
#endif

at::Tensor gemm_gguf(const at::Tensor& x, const at::Tensor& w, int64_t type, const c10::optional<at::Tensor>& bias) {
  at::Tensor bias32;
  const int64_t k = check_gemm(x, w, type, bias, "gemm_gguf", bias32), n = w.size(0), m = x.size(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float* bp = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  // bf16 x widened once per call into a plain buffer: a few rows, cheaper than a tensor conversion op.
  // 64-byte aligned (rows of k = 32 * blocks floats stay aligned): x loads that split cache lines made
  // 8 rows of x 1.1-1.4x slower.
  std::vector<float> widened;
  const float* xp = bf16 ? nullptr : x.data_ptr<float>();
  int64_t x_stride = x.stride(0);
  if (bf16) {
    widened.resize(m * k + 15);
    float* xw = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(widened.data()) + 63) & ~uintptr_t{63});
    const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < k; ++j) xw[r * k + j] = static_cast<float>(xb[r * x_stride + j]);
    xp = xw, x_stride = k;
  }
#if defined(PAGEDSERVE_GGUF_DECODE)
  const decode::Args a{xp, x_stride, k, w.data_ptr<uint8_t>(), n, w.size(1), bp, y.data_ptr()};
  PAGEDSERVE_GGUF_DISPATCH(type, decode_typed, a, m, bf16)
  return y;
#else
  at::Tensor y32 = bf16 ? at::empty({m, n}, x.options().dtype(at::kFloat)) : y;
  GgufArgs a{xp, x_stride, k, w.data_ptr<uint8_t>(), w.size(1), bp, y32.data_ptr<float>(), n};
  PAGEDSERVE_GGUF_DISPATCH(type, gguf_gemm_typed, a, m, n)
  if (bf16) y.copy_(y32);
  return y;
#endif
}

at::Tensor dequant_gguf(const at::Tensor& w, int64_t type) {
  const int64_t k = features(w, type, "dequant_gguf"), n = w.size(0);
  at::Tensor out = at::empty({n, k}, w.options().dtype(at::kFloat));
  if (n == 0) return out;
  PAGEDSERVE_GGUF_DISPATCH(type, gguf_dequant_typed, w.data_ptr<uint8_t>(), w.size(1), n, k, out.data_ptr<float>())
  return out;
}

}  // namespace

PAGEDSERVE_LIBRARY_FRAGMENT(m) {
  m.def("gemm_gguf(Tensor x, Tensor w, int type, Tensor? bias) -> Tensor");
  m.def("dequant_gguf(Tensor w, int type) -> Tensor");
  m.impl("gemm_gguf", c10::DispatchKey::CPU, gemm_gguf);
  m.impl("dequant_gguf", c10::DispatchKey::CPU, dequant_gguf);
}
