// Small-batch float32 matmul over weights stored in the GGUF block formats they exactly came from.
//
// The embedded model's fp32 weights are dequantized Q4_1 / Q8_0 blocks (32 weights along the input dim):
//   Q4_1: w = d * q + m, q in [0, 15]       qs [N, K/2] uint8 (byte j of a block: q[j] | q[j + 16] << 4),
//                                            dm [N, K/32, 2] float32 (d, m)
//   Q8_0: w = d * q,     q in [-127, 127]    qs [N, K] int8, d [N, K/32] float32
// pagedserve/model/layers/quant.py finds these blocks from the fp32 tensor and keeps them only when they
// reproduce every weight bit for bit, so y = x W^T here uses exactly the fp32 weights (d * q is exact in
// float32, so fma(d, q, m) rounds like the dequantizer's d * q + m). Reading 0.75 or 1.125 bytes per
// weight instead of 4 is what makes decode at batch 1-4 fast: it is memory-bound on the weights.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>

#include "checks.h"
#include "ops_library.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRows = 8;  // rows of x per pass; 2 * kMaxRows accumulators stay in registers

struct Args {
  const float* x;
  int64_t x_stride, k;
  const uint8_t* qs;
  const float* scales;  // Q4_1: (d, m) pairs; Q8_0: d
  const float* bias;
  float* y;
  int64_t y_stride;
};

template <bool Q4, int MR>
void rows_out(const Args& a, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t nb = a.k / kBlock;
  const int64_t row_bytes = Q4 ? a.k / 2 : a.k;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = a.qs + n * row_bytes;
    const float* sc = a.scales + n * nb * (Q4 ? 2 : 1);
    float out[MR];
#if defined(__AVX512F__)
    __m512 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 w0, w1;
      if constexpr (Q4) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
        const __m512 d = _mm512_set1_ps(sc[2 * b]), m = _mm512_set1_ps(sc[2 * b + 1]);
        w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), m);
        w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), m);
      } else {
        const __m512 d = _mm512_set1_ps(sc[b]);
        const __m128i* p = reinterpret_cast<const __m128i*>(q + b * 32);
        w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))));
        w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))));
      }
      for (int r = 0; r < MR; ++r) {
        const float* xr = a.x + (m0 + r) * a.x_stride + b * kBlock;
        acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
#else
    for (int r = 0; r < MR; ++r) out[r] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      float w[kBlock];
      for (int64_t j = 0; j < kBlock; ++j) {
        if constexpr (Q4) {
          const uint8_t byte = q[b * 16 + (j & 15)];
          w[j] = sc[2 * b] * static_cast<float>(j < 16 ? byte & 15 : byte >> 4) + sc[2 * b + 1];
        } else {
          w[j] = sc[b] * static_cast<float>(static_cast<int8_t>(q[b * 32 + j]));
        }
      }
      for (int r = 0; r < MR; ++r) {
        const float* xr = a.x + (m0 + r) * a.x_stride + b * kBlock;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < kBlock; ++j) s += w[j] * xr[j];
        out[r] += s;
      }
    }
#endif
    for (int r = 0; r < MR; ++r) a.y[(m0 + r) * a.y_stride + n] = out[r] + (a.bias ? a.bias[n] : 0.f);
  }
}

template <bool Q4>
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& bias) {
  using pagedserve::check_tensor;
  using pagedserve::Layout;
  constexpr const char* op = Q4 ? "gemm_q4_1" : "gemm_q8_0";
  constexpr const char* scales_name = Q4 ? "dm" : "d";
  check_tensor(x, op, "x", at::kFloat, 2, Layout::kRows);
  check_tensor(qs, op, "qs", Q4 ? at::kByte : at::kChar, 2, Layout::kContiguous);
  check_tensor(scales, op, scales_name, at::kFloat, Q4 ? 3 : 2, Layout::kContiguous);
  const int64_t k = x.size(1), n = qs.size(0), nb = k / kBlock;
  TORCH_CHECK(k % kBlock == 0, op, ": x's last dimension (", k, ") must be a multiple of the block size ", kBlock);
  TORCH_CHECK(qs.size(1) == (Q4 ? k / 2 : k), op, ": qs must be [out_features, ",
              Q4 ? "in_features / 2" : "in_features", "] = [N, ", Q4 ? k / 2 : k, "] for x ", x.sizes(), ", got ",
              qs.sizes());
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == nb && (!Q4 || scales.size(2) == 2), op, ": ", scales_name,
              " must be [", n, ", ", nb, Q4 ? ", 2]" : "]", " (one scale", Q4 ? " pair" : "", " per block of ", kBlock,
              "), got ", scales.sizes());
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_tensor(*bias, op, "bias", at::kFloat, 1, Layout::kContiguous);
    TORCH_CHECK(bias->size(0) == n, op, ": bias has ", bias->size(0), " entries, the weight has ", n, " rows");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  Args a{x.data_ptr<float>(), x.stride(0), k, static_cast<const uint8_t*>(qs.data_ptr()), scales.data_ptr<float>(),
         bp, y.data_ptr<float>(), y.stride(0)};
  const int64_t m = x.size(0);
  // Threads split the output features; every thread reads only its own weight rows.
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t c0 = n0; c0 < n1; c0 += 8) {  // 8 weight rows stay in L1 across the passes over x
      const int64_t c1 = std::min(c0 + 8, n1);
      for (int64_t m0 = 0; m0 < m; m0 += kMaxRows) {
        switch (std::min(kMaxRows, m - m0)) {
          case 8: rows_out<Q4, 8>(a, m0, c0, c1); break;
          case 7: rows_out<Q4, 7>(a, m0, c0, c1); break;
          case 6: rows_out<Q4, 6>(a, m0, c0, c1); break;
          case 5: rows_out<Q4, 5>(a, m0, c0, c1); break;
          case 4: rows_out<Q4, 4>(a, m0, c0, c1); break;
          case 3: rows_out<Q4, 3>(a, m0, c0, c1); break;
          case 2: rows_out<Q4, 2>(a, m0, c0, c1); break;
          default: rows_out<Q4, 1>(a, m0, c0, c1); break;
        }
      }
    }
  });
  return y;
}

}  // namespace

PAGEDSERVE_LIBRARY_FRAGMENT(m) {
  m.def("gemm_q4_1(Tensor x, Tensor qs, Tensor dm, Tensor? bias) -> Tensor");
  m.def("gemm_q8_0(Tensor x, Tensor qs, Tensor d, Tensor? bias) -> Tensor");
  m.impl("gemm_q4_1", c10::DispatchKey::CPU, quant_gemm<true>);
  m.impl("gemm_q8_0", c10::DispatchKey::CPU, quant_gemm<false>);
}
