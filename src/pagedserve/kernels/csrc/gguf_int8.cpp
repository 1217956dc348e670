// The int8-activation block GEMM of gguf_int8.h as ops:
//   gemm_gguf_int8(x [M, K] f32 or bf16, w [N, row_bytes] u8, type, bias?, vnni?, batch_invariant=False)
//       -> y [M, N] = x^ W^T (+ bias)
//     x^: x quantized to int8 per 256 values (gguf_int8.h); y in x's dtype. vnni: None takes AVX512-VNNI where
//     the CPU has it; False the dot products without it (vpmaddubsw + vpmaddwd); True requires VNNI.
//     By default the rows of x pick the driver (1-4 rows gguf_int8_gemv.h, 5-31 gguf_int8.h, 32+
//     gguf_int8_tiles.h), each adding a row's products in its own order; batch_invariant takes gguf_int8.h's
//     driver at every M, so each row of y is bit for bit the same whatever the rows beside it.
//   gguf_int8_types(vnni?) -> the GGML types gemm_gguf_int8 multiplies in this build on this CPU (empty:
//     none), with the dot products `vnni` picks as above
//   gguf_int8_gemv_types() -> the types whose 1-4 rows of x take a few-row kernel (gguf_int8_gemv.h: Q4_K,
//     Q5_K, Q6_K in the avx2, avx512 and amx builds; Q4_1 and Q8_0 in the avx2 build; Q8_0, IQ4_XS in the
//     avx512 and amx builds on CPUs with AVX512-VNNI; baseline: none)
// model/layers/gguf_quant.py's kernel_choice decides when it runs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "checks.h"
#include "gguf_blocks.h"
#include "gguf_int8.h"
#include "gguf_int8_tiles.h"
#if defined(PAGEDSERVE_GGUF_INT8)
#include "gguf_int8_gemv.h"
#endif
#include "ops_library.h"

namespace {

using namespace pagedserve::gguf;

// vnni: None the dot products gemm_gguf_int8 takes by default; False those without VNNI (no Q8_0, IQ4_XS); True
// VNNI's (none without it)
std::vector<int64_t> gguf_int8_types(c10::optional<bool> vnni) {
#if defined(PAGEDSERVE_GGUF_INT8)
  const bool has_vnni = int8::cpu_has_vnni();
  if (vnni.value_or(false) && !has_vnni) return {};
  return int8::types(vnni.value_or(has_vnni));
#else
  (void)vnni;
  return {};
#endif
}

#if defined(PAGEDSERVE_GGUF_INT8)
// The k-quants and IQ4_XS from int8::tiles::kMinRows rows of x through gguf_int8_tiles.h's driver, the rest
// through gguf_int8.h's.
template <int64_t T, typename Out>
void run(const int8::Args& a, bool vnni, bool invariant) {
  if constexpr (int8::tiles::kTiles<T>) {
    if (a.m >= int8::tiles::kMinRows && !invariant) return int8::tiles::gemm<T, Out>(a, vnni);
  }
  int8::gemm<T, Out>(a, vnni);
}
#endif

// The types gemm_gguf_int8 runs through the few-row kernel (gguf_int8_gemv.h) for 1 to 4 rows of x.
std::vector<int64_t> gguf_int8_gemv_types() {
#if defined(PAGEDSERVE_GGUF_INT8)
  std::vector<int64_t> out;
  for (int64_t t : {kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kIQ4_XS})
    if (int8::gemv::has_row_kernel(t, int8::cpu_has_vnni())) out.push_back(t);
  return out;
#else
  return {};
#endif
}

at::Tensor gemm_gguf_int8(const at::Tensor& x, const at::Tensor& w, int64_t type,
                          const c10::optional<at::Tensor>& bias, c10::optional<bool> vnni, bool invariant) {
  constexpr const char* op = "gemm_gguf_int8";
  at::Tensor bias32;
  const int64_t k = check_gemm(x, w, type, bias, op, bias32), n = w.size(0), m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
#if defined(PAGEDSERVE_GGUF_INT8)
  const bool has_vnni = int8::cpu_has_vnni();
  TORCH_CHECK(!vnni.value_or(false) || has_vnni, op, ": this CPU has no AVX512-VNNI");
  const bool use_vnni = vnni.value_or(has_vnni);
  // a type may have the few-row kernel only (Q4_1, Q8_0 on avx2): then only for 1-4 rows, never batch-invariant
  const bool few_rows = !invariant && int8::gemv::takes(type, std::max<int64_t>(m, 1), use_vnni);
  const std::vector<int64_t> types = int8::types(use_vnni);
  TORCH_CHECK(few_rows || std::find(types.begin(), types.end(), type) != types.end(), op, ": GGML type ", type,
              " has no int8 kernel in the ", pagedserve::compiled_isa(), " build",
              int8::gemv::takes(type, 1, use_vnni) ? " beyond the few-row kernel's 1-4 rows of x" : "");
  if (m == 0 || n == 0) return y;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (few_rows) {  // single-stream decode
    const float* xf = bf16 ? nullptr : x.data_ptr<float>();
    const c10::BFloat16* xb = bf16 ? x.data_ptr<c10::BFloat16>() : nullptr;
    const float* bp = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
    int8::gemv::run(type, xf, xb, x.stride(0), m, k, w.data_ptr<uint8_t>(), n, w.size(1), bp, y.data_ptr(), use_vnni);
    return y;
  }
  // x quantized: rows of kpad quants (64-byte aligned vectors), per group its scale and 16 sums
  const int64_t groups = (k + int8::kGroup - 1) / int8::kGroup, kpad = groups * int8::kGroup;
  std::vector<int8_t> q(m * kpad + 64);
  std::vector<float> d(m * groups), s16(m * groups * 16);
  int8_t* qp = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(q.data()) + 63) & ~uintptr_t{63});
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> widened(bf16 ? k : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row;
      if (bf16) {
        const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>() + r * x.stride(0);
        for (int64_t j = 0; j < k; ++j) widened[j] = static_cast<float>(xb[j]);
        row = widened.data();
      } else {
        row = x.data_ptr<float>() + r * x.stride(0);
      }
      int8::quantize_row(row, k, qp + r * kpad, d.data() + r * groups, s16.data() + r * groups * 16);
    }
  });
  const int8::Args a{{qp, d.data(), s16.data(), kpad, groups}, m, k, w.data_ptr<uint8_t>(), n, w.size(1),
                     bias32.defined() ? bias32.data_ptr<float>() : nullptr, y.data_ptr()};
#define PAGEDSERVE_INT8_CASE(T) \
  case T: bf16 ? run<T, c10::BFloat16>(a, use_vnni, invariant) : run<T, float>(a, use_vnni, invariant); break;
  switch (type) {
    PAGEDSERVE_INT8_CASE(kQ4_0)
    PAGEDSERVE_INT8_CASE(kQ4_1)
    PAGEDSERVE_INT8_CASE(kQ5_0)
    PAGEDSERVE_INT8_CASE(kQ5_1)
    PAGEDSERVE_INT8_CASE(kQ8_0)
    PAGEDSERVE_INT8_CASE(kQ4_K)
    PAGEDSERVE_INT8_CASE(kQ5_K)
    PAGEDSERVE_INT8_CASE(kQ6_K)
    PAGEDSERVE_INT8_CASE(kIQ4_XS)
    default: break;
  }
#undef PAGEDSERVE_INT8_CASE
#else
  (void)vnni, (void)k, (void)invariant, (void)m, (void)n;
  TORCH_CHECK(false, op, ": GGML type ", type, " has no int8 kernel in the ", pagedserve::compiled_isa(), " build");
#endif
  return y;
}

}  // namespace

PAGEDSERVE_LIBRARY_FRAGMENT(m) {
  m.def("gemm_gguf_int8(Tensor x, Tensor w, int type, Tensor? bias, bool? vnni=None, bool batch_invariant=False) -> Tensor");
  m.impl("gemm_gguf_int8", c10::DispatchKey::CPU, gemm_gguf_int8);
  m.def("gguf_int8_types(bool? vnni=None) -> int[]", &gguf_int8_types);
  m.def("gguf_int8_gemv_types() -> int[]", &gguf_int8_gemv_types);
}
