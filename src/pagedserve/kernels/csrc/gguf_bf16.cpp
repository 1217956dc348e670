// The bf16 block GEMM for many rows of x (prefill), on CPUs with bf16 dot products (AVX512-BF16 or AMX):
//   gemm_gguf_bf16(x [M, K] f32 or bf16, w [N, row_bytes] u8, type, bias?) -> y [M, N] = x W^T (+ bias), x's dtype
//   gguf_bf16_types() -> the GGML types it multiplies in this build on this CPU (empty: none)
//   dequant_gguf_bf16(w, type) -> w's rows as bf16 [N, K], as the panels hold them (avx512 and amx builds, any
//     CPU that runs them: integer rounding, no bf16 instruction)
// model/layers/gguf_quant.py's kernel_choice decides when it runs.
//
// Each panel of kPanelRows weight rows (fewer where a thread would get none) is rebuilt once per call, kPanelBytes
// of it at a time (64 rows x 2,048 of K, 256 rows on AMX: it stays in L2), as gguf_rebuild.h's floats (the very ones
// dequant_gguf returns) rounded to bf16 as torch's .to(bfloat16) does, and multiplied by every row of x with
// oneDNN's brgemm micro-kernel (at::native::cpublas::brgemm: vdpbf16ps on AVX512-BF16, tiles on AMX; float32 sums),
// the roles swapped as in gguf_amx.cpp so that the weights need no transpose: C^T [panel rows, rows of x] = W_panel
// x^T. The brgemm's A is the panel as rebuilt (row-major, K contiguous); its B is x^T in the VNNI pair layout it
// wants ([K / 2][chunk][2] bf16: word (p, i) holds x[i][2p], x[i][2p + 1]), built once per call for chunks of kChunk
// rows of x (the last padded with zero rows to a multiple of 16). Each chunk's sums stay in its own C block across K
// (add_C, kSlice of K per call); once the panel's K is done, C^T goes into y transposed 16 x 16 at a time, plus the
// bias, rounded once to y's dtype. Threads take the next panel as they finish one. Results equal bf16(x) bf16(W)^T
// up to float32 rounding of the sums (a product of two bf16 is exact in float32). The brgemm kernels oneDNN
// generates are cached per (M, N, K, ld, add_C) and thread; the shapes here are fixed per weight (M = the panel rows, N
// a multiple of 16 up to kChunk, K = kSlice or a tail), so there are few.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "amx_state.h"
#include "checks.h"
#include "gguf_blocks.h"
#include "gguf_rebuild.h"
#include "ops_library.h"
#include "simd_transpose.h"

#if defined(PAGEDSERVE_GGUF_DECODE) && defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDSERVE_GGUF_BF16 1
#endif

namespace {

using namespace pagedserve::gguf;

#if defined(PAGEDSERVE_GGUF_BF16)

using decode::Rebuild;
using decode::Vec;

// Measured on Llama-1B shapes at 512 rows of x, 1 thread, CPU time per call, 2-core EPYC Zen 4 at load ~12
// (benchmarks/README.md): 32-row panels 0.65-0.8x the speed of 64-row ones, 128-row ones no faster; K slices of
// 256-2,048 per brgemm call within noise (+-10%), panels of 4,096 of K slower.
constexpr int64_t kChunk = 64;              // rows of x per brgemm call (its N)
#if defined(PAGEDSERVE_AMX)
// AMX multiplies ~3x faster than vdpbf16ps, so streaming all of x (bf16, 2 MB at 512 rows x 2,048 of K: past L2)
// once per panel becomes the cost; 4x taller panels read it 4x less (1 MB of panel + a 256 KB chunk of x stay in
// a Sapphire Rapids core's 2 MB L2).
constexpr int64_t kPanelRows = 256;
constexpr int64_t kPanelBytes = 1 << 20;
#else
constexpr int64_t kPanelRows = 64;          // weight rows per panel (the brgemm's M)
constexpr int64_t kPanelBytes = 256 << 10;  // a panel's bf16 weights: kPanelRows rows of up to 2,048 of K at a time
#endif
constexpr int64_t kSlice = 1024;            // K per brgemm call

// 16 floats as 16 bf16, rounded to nearest even (torch's .to(bfloat16) for finite values)
inline __m256i bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// rows of w (nb blocks each) as bf16 rows of `ld` elements
template <int64_t T>
void rebuild_rows(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t nb, uint16_t* out, int64_t ld) {
  constexpr int64_t E = Format<T>::kElems, B = Format<T>::kBytes;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + r * row_bytes;
    uint16_t* o = out + r * ld;
    for (int64_t b = 0; b < nb; ++b, o += E) {
      const Rebuild<T> blk(row + b * B);
      for (int j = 0; j < E / 32; ++j) {
        Vec v[2];
        blk.sub(j, v);
#if defined(__AVX512BF16__)
        // one instruction for 32 (nearest even, as bf16x16; its flushing of denormals never applies: every
        // type's weights are 0 or multiples of 2^-24, an fp16 scale's smallest step)
        _mm512_storeu_si512(o + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
#else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * j), bf16x16(v[0]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * j + 16), bf16x16(v[1]));
#endif
      }
    }
  }
}

using RebuildFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, uint16_t*, int64_t);

RebuildFn rebuild_fn(int64_t type) {
  switch (type) {
    case kQ4_0: return rebuild_rows<kQ4_0>;
    case kQ4_1: return rebuild_rows<kQ4_1>;
    case kQ5_0: return rebuild_rows<kQ5_0>;
    case kQ5_1: return rebuild_rows<kQ5_1>;
    case kQ8_0: return rebuild_rows<kQ8_0>;
    case kQ4_K: return rebuild_rows<kQ4_K>;
    case kQ5_K: return rebuild_rows<kQ5_K>;
    case kQ6_K: return rebuild_rows<kQ6_K>;
    case kIQ4_XS: return rebuild_rows<kIQ4_XS>;
    default: return nullptr;
  }
}

// 16 rows of x from r (rows past m are zeros), pairs p0 .. p0 + 15 (32 values) of each, as 16 vectors of bf16 pairs
template <typename In>
inline void load_pairs(const In* x, int64_t stride, int64_t r, int64_t m, int64_t p0, __m512* rows) {
  for (int i = 0; i < 16; ++i) {
    if (r + i >= m) {
      rows[i] = _mm512_setzero_ps();
      continue;
    }
    const In* src = x + (r + i) * stride + 2 * p0;
    __m512i v;
    if constexpr (std::is_same_v<In, float>) {
      const __m256i lo = bf16x16(_mm512_loadu_ps(src)), hi = bf16x16(_mm512_loadu_ps(src + 16));
      v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    } else {
      v = _mm512_loadu_si512(src);
    }
    rows[i] = _mm512_castsi512_ps(v);
  }
}

// x [m, k] -> chunks of kChunk rows as brgemm's B: chunk c at xt + c * kChunk * k, [k / 2][width][2] bf16 with
// width = its rows rounded up to 16 (zero rows past m)
template <typename In>
void pack_x(const In* x, int64_t stride, int64_t m, int64_t k, uint16_t* xt) {
  const int64_t chunks = (m + kChunk - 1) / kChunk, tiles = (k / 2) / 16;
  at::parallel_for(0, chunks * tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t / tiles, p0 = (t % tiles) * 16, r0 = c * kChunk;
      const int64_t width = (std::min(kChunk, m - r0) + 15) / 16 * 16;
      uint32_t* out = reinterpret_cast<uint32_t*>(xt + c * kChunk * k);
      for (int64_t i0 = 0; i0 < width; i0 += 16) {
        __m512 rows[16], cols[16];
        load_pairs(x, stride, r0 + i0, m, p0, rows);
        pagedserve::transpose16(rows, cols);
        for (int p = 0; p < 16; ++p) _mm512_storeu_ps(reinterpret_cast<float*>(out + (p0 + p) * width + i0), cols[p]);
      }
    }
  });
}

// y[r0 + i][n0 + j] = ct[j][i] (+ bias[n0 + j]) for i < rows, j < cols; ct is [panel rows][width]
template <typename Out>
void store_transposed(const float* ct, int64_t width, int64_t rows, int64_t cols, const float* bias, Out* y,
                      int64_t n, int64_t r0, int64_t n0) {
  for (int64_t j0 = 0; j0 < cols; j0 += 16) {
    const __mmask16 keep = static_cast<__mmask16>(cols - j0 >= 16 ? 0xFFFF : (1u << (cols - j0)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0 + j0) : _mm512_setzero_ps();
    for (int64_t i0 = 0; i0 < rows; i0 += 16) {
      __m512 in[16], out[16];
      // ct has panel rows (a multiple of 64) >= j0 + 16
      for (int j = 0; j < 16; ++j) in[j] = _mm512_loadu_ps(ct + (j0 + j) * width + i0);
      pagedserve::transpose16(in, out);
      for (int i = 0; i < 16 && i0 + i < rows; ++i) {
        Out* dst = y + (r0 + i0 + i) * n + n0 + j0;
        const __m512 v = _mm512_add_ps(out[i], b);
        if constexpr (std::is_same_v<Out, float>) {
          _mm512_mask_storeu_ps(dst, keep, v);
        } else {
          _mm256_mask_storeu_epi16(dst, keep, bf16x16(v));
        }
      }
    }
  }
}

// brgemm's bf16 kernel with the VNNI B layout on this CPU, checked once on a small product against float sums
bool brgemm_works() {
  static const bool ok = [] {
#if !defined(PAGEDSERVE_AMX)
    if (!__builtin_cpu_supports("avx512bf16")) return false;
#endif
    constexpr int64_t M = 16, N = 16, K = 64;
    std::vector<c10::BFloat16> a(M * K), b(K * N);
    std::vector<float> c(M * N, 0.f);
    for (int64_t i = 0; i < M * K; ++i) a[i] = static_cast<float>((i * 7) % 13) - 6.f;
    for (int64_t i = 0; i < K * N; ++i) b[i] = static_cast<float>((i * 5) % 11) - 5.f;  // [K / 2][N][2]
    try {
      at::native::cpublas::brgemm(M, N, K, K, N, N, false, a.data(), b.data(), c.data(), true);
      at::native::cpublas::brgemm_release(true);
    } catch (const c10::Error&) {
      return false;
    }
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        float s = 0.f;
        for (int64_t p = 0; p < K; ++p)
          s += static_cast<float>(a[i * K + p]) * static_cast<float>(b[(p / 2 * N + j) * 2 + p % 2]);
        if (s != c[i * N + j]) return false;
      }
    return true;
  }();
  return ok;
}

template <typename Out>
void gemm(const uint16_t* xt, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes, int64_t elems,
          int64_t bytes, RebuildFn rebuild, const float* bias, Out* y) {
  // panels of kPanelRows weight rows, shorter (down to 64) where that leaves a thread without one
  const int64_t threads = at::get_num_threads();
  const int64_t np = std::clamp<int64_t>(((n + threads - 1) / threads + 63) / 64 * 64, 64, kPanelRows);
  const int64_t ks = std::min(k, std::max<int64_t>(elems, kPanelBytes / (2 * np) / elems * elems));
  const int64_t panels = (n + np - 1) / np, chunks = (m + kChunk - 1) / kChunk;
  std::atomic<int64_t> next{0};
  // one task per thread, each taking the next panel until none is left: a thread that gets less of the CPU
  // (a shared machine) takes fewer panels instead of holding the others at the end
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), panels), 1, [&](int64_t, int64_t) {
    auto panel = std::make_unique<uint16_t[]>(np * ks + 32);
    auto ct = std::make_unique<float[]>(chunks * np * kChunk + 16);
    uint16_t* a = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(panel.get()) + 63) & ~uintptr_t{63});
    float* c = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(ct.get()) + 63) & ~uintptr_t{63});
    for (int64_t p; (p = next.fetch_add(1)) < panels;) {
      const int64_t n0 = p * np, rows = std::min(np, n - n0);
      for (int64_t k0 = 0; k0 < k; k0 += ks) {
        const int64_t kk = std::min(ks, k - k0);
        rebuild(w + n0 * row_bytes + k0 / elems * bytes, row_bytes, rows, kk / elems, a, kk);
        if (rows < np) std::memset(a + rows * kk, 0, (np - rows) * kk * sizeof(uint16_t));
        for (int64_t ch = 0; ch < chunks; ++ch) {
          const int64_t width = (std::min(kChunk, m - ch * kChunk) + 15) / 16 * 16;
          const uint16_t* b = xt + ch * kChunk * k + k0 * width;
          for (int64_t s0 = 0; s0 < kk; s0 += kSlice) {
            at::native::cpublas::brgemm(np, width, std::min(kSlice, kk - s0), kk, width, width, k0 + s0 > 0,
                                        reinterpret_cast<const c10::BFloat16*>(a + s0),
                                        reinterpret_cast<const c10::BFloat16*>(b + s0 * width),
                                        c + ch * np * kChunk, true);
          }
        }
      }
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t r0 = ch * kChunk, xrows = std::min(kChunk, m - r0), width = (xrows + 15) / 16 * 16;
        store_transposed(c + ch * np * kChunk, width, xrows, rows, bias, y, n, r0, n0);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}

#endif

std::vector<int64_t> gguf_bf16_types() {
#if defined(PAGEDSERVE_GGUF_BF16)
  if (brgemm_works()) return {kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kIQ4_XS};
#endif
  return {};
}

at::Tensor gemm_gguf_bf16(const at::Tensor& x, const at::Tensor& w, int64_t type,
                          const c10::optional<at::Tensor>& bias) {
  constexpr const char* op = "gemm_gguf_bf16";
  at::Tensor bias32;
  const int64_t k = check_gemm(x, w, type, bias, op, bias32), n = w.size(0), m = x.size(0);
  TORCH_CHECK(!gguf_bf16_types().empty(), op, ": no bf16 brgemm in the ", pagedserve::compiled_isa(),
              " build on this CPU (it needs AVX512-BF16 or AMX)");
  at::Tensor y = at::empty({m, n}, x.options());
#if defined(PAGEDSERVE_GGUF_BF16)
  if (m == 0 || n == 0) return y;
  int64_t elems, bytes;
  block_shape(type, elems, bytes);
  // x^T in chunks of kChunk rows, each [k / 2][width <= kChunk][2]
  at::Tensor xt = at::empty({(m + kChunk - 1) / kChunk * kChunk * k}, x.options().dtype(at::kBFloat16));
  uint16_t* xtp = reinterpret_cast<uint16_t*>(xt.data_ptr<at::BFloat16>());
  const float* bp = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const RebuildFn rebuild = rebuild_fn(type);
  if (x.scalar_type() == at::kBFloat16) {
    pack_x(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), m, k, xtp);
    uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    gemm(xtp, m, k, wp, n, w.size(1), elems, bytes, rebuild, bp, yp);
  } else {
    pack_x(x.data_ptr<float>(), x.stride(0), m, k, xtp);
    gemm(xtp, m, k, wp, n, w.size(1), elems, bytes, rebuild, bp, y.data_ptr<float>());
  }
#endif
  return y;
}

// w's rows as bf16 [N, K]: the floats dequant_gguf returns, rounded to nearest even (what a panel holds)
at::Tensor dequant_gguf_bf16(const at::Tensor& w, int64_t type) {
  constexpr const char* op = "dequant_gguf_bf16";
  const int64_t k = features(w, type, op), n = w.size(0);
#if !defined(PAGEDSERVE_GGUF_BF16)
  TORCH_CHECK(false, op, ": the ", pagedserve::compiled_isa(), " build has no bf16 rebuild (avx512 and amx do)");
#endif
  at::Tensor out = at::empty({n, k}, w.options().dtype(at::kBFloat16));
#if defined(PAGEDSERVE_GGUF_BF16)
  int64_t elems, bytes;
  block_shape(type, elems, bytes);
  const RebuildFn rebuild = rebuild_fn(type);
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    rebuild(w.data_ptr<uint8_t>() + r0 * w.size(1), w.size(1), r1 - r0, k / elems, o + r0 * k, k);
  });
#endif
  return out;
}

}  // namespace

PAGEDSERVE_LIBRARY_FRAGMENT(m) {
  m.def("gemm_gguf_bf16(Tensor x, Tensor w, int type, Tensor? bias) -> Tensor");
  m.impl("gemm_gguf_bf16", c10::DispatchKey::CPU, gemm_gguf_bf16);
  m.def("gguf_bf16_types() -> int[]", &gguf_bf16_types);
  m.def("dequant_gguf_bf16(Tensor w, int type) -> Tensor");
  m.impl("dequant_gguf_bf16", c10::DispatchKey::CPU, dequant_gguf_bf16);
}
