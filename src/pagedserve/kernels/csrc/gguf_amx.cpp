// bf16 matmul over raw GGUF Q4_1 / Q8_0 blocks with AMX tiles (Sapphire Rapids and later); only the `amx`
// variant registers it (other builds compile this file to nothing, and Python takes the portable path).
//
//   gemm_gguf_amx(x [M, K] bf16, w [N, row_bytes] u8, type, bias?, dtype?) -> y [M, N] = x W^T (+ bias)
//
// Decode with dense bf16 weights is bound by reading them, 2 bytes per weight; Q4_1 reads 0.625, Q8_0 1.06.
// Rebuilding the blocks then costs about as much as reading them (benchmarks/README.md, "AMX block GEMM").
// The blocks are rebuilt in registers (d * q + m in float32, the very floats dequant_gguf returns, then
// rounded to bf16 as torch's .to(bfloat16) does) and multiplied by TDPBF16PS, which accumulates in float32.
//
// Roles are swapped so that neither side needs a transpose per weight block: C^T = W x^T. A tile = 16 weight
// rows x 32 bf16 along K, which is exactly a dequantized row's natural layout; B tile = x^T in the VNNI pair
// layout (16 K-pairs x 16 rows of x), built once per call since x is small; C tile = 16 weight rows x 16 x
// rows, stored transposed into y. A thread takes 32 weight rows at a time, rebuilds them for up to 640 of K
// (longer K in equal chunks) into a bf16 buffer that stays in L1, then runs every 16-row tile of x (padded
// with zero rows) against them, two at a time: 2 A x 2 B -> 4 C tiles. Rows of w past N are zero rows of the
// buffer, so N need not be a multiple of 16.
// With at most two tiles of x (decode batches of up to 32 sequences) the rows are rebuilt one block column at
// a time instead, into a 2 KB buffer that stays in L1 (stream_pass). Measured per shape at 16 rows of x, 2
// threads, weights cold: 0.7-0.9x the time of whole-row rebuilds (benchmarks/README.md, "The decode step at
// 16 sequences").
// From kDenseRows rows of x on (prefill), with a bf16 result, the weight is rebuilt as bf16 instead
// (dequant_rows_bf16: the same values, kDenseChunk weights at a time) and multiplied by torch's bf16 GEMM
// (oneDNN, on AMX): 1.5-1.9x faster at 512 rows on the embedded model's shapes with the weights in cache,
// rebuild included (benchmarks/README.md, "Shared prefixes read once, ..., prefill GEMM through oneDNN"); the
// offline LLM (2,048-token budget, steps of 512-1,023 rows) 1.12-1.19x faster. At 256-511 rows (the server's
// 512-token steps) the tiles serve better: the server took 1.04-1.14x the output tokens/s with the limit at 512
// instead of 256 in four pairs of runs (benchmarks/README.md, "Prefill GEMM limit (session 9)"). Its sums are
// float32 too, in another order, and the bias is added in bf16.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include "amx_state.h"

#if defined(PAGEDSERVE_AMX)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "gguf_blocks.h"
#include "gguf_decode.h"
#include "ops_library.h"
#include "simd_transpose.h"

namespace {

using namespace pagedserve::gguf;

constexpr int64_t kRowsPerPass = 32;  // weight rows per buffer: two A tiles
constexpr int64_t kMaxChunkBlocks = 20;  // block columns per buffer: 32 rows x 640 bf16 = 40 KB
constexpr int64_t kDenseRows = 512;
constexpr int64_t kDenseChunk = 4 << 20;  // weights rebuilt at a time (8 MB of bf16): the LM head goes in parts

// Tiles 0-3: C (16 x 16 float32); 4, 5: A (16 weight rows x 32 bf16); 6, 7: B (16 K-pairs x 16 x rows x 2 bf16).
using pagedserve::TileConfig;

// One block of 32 weights as bf16, its scale d (and Q4_1's min m) already widened to float32 in memory, so
// they reach the arithmetic as broadcast loads (no shuffle-port work; decode::scales gathers them 16 blocks at
// a time). Q4_1: the 16 values a nibble can stand for, d * j + m (d * j is exact in float32, so the fused
// multiply-add rounds once, like d * q + m), rounded to bf16 once and looked up by each nibble (vpermw);
// Q8_0: bf16(d * q). Either way the very bf16 that dequant_gguf's floats round to.
template <int64_t T>
inline void dequant_block_bf16(const uint8_t* blk, const float* d, const float* m, uint16_t* out) {
  __m512i w;
  if constexpr (T == kQ4_1) {
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i table = _mm512_castsi256_si512(reinterpret_cast<__m256i>(
        _mm512_cvtneps_pbh(_mm512_fmadd_ps(iota, _mm512_set1_ps(*d), _mm512_set1_ps(*m)))));
    // bytes 0-15 widened twice: weights 0-15 are their low nibbles, 16-31 their high nibbles
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)));
    const __m512i idx =
        _mm512_and_si512(_mm512_srlv_epi16(_mm512_cvtepu8_epi16(q), shift), _mm512_set1_epi16(15));
    w = _mm512_permutexvar_epi16(idx, table);
  } else {
    static_assert(T == kQ8_0);
    const __m512 dv = _mm512_set1_ps(*d);
    const __m128i* q = reinterpret_cast<const __m128i*>(blk + 2);
    const __m512 lo = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    const __m512 hi = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
    w = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  }
  _mm512_storeu_si512(out, w);
}

// One row of weights, nb blocks of 32, as bf16.
template <int64_t T>
void dequant_row_bf16(const uint8_t* row, int64_t nb, uint16_t* out) {
  constexpr int64_t B = Format<T>::kBytes, kChunk = decode::kChunk;
  alignas(64) float d[kChunk], m[kChunk];
  for (int64_t c = 0; c < nb; c += kChunk) {
    const int64_t count = std::min(kChunk, nb - c);
    decode::scales<T>(row + c * B, count, d, m);
    for (int64_t j = 0; j < count; ++j) {
      const uint8_t* blk = row + (c + j) * B;
      // weights are read once per call: request the bytes decode::kAhead further on, so a thread streams
      // its rows instead of waiting on each line
      _mm_prefetch(reinterpret_cast<const char*>(blk + decode::kAhead), _MM_HINT_T0);
      dequant_block_bf16<T>(blk, d + j, m + j, out + 32 * (c + j));
    }
  }
}

struct AmxArgs {
  const uint16_t* xv;  // x in B-tile layout: [K/32][M tiles][16 pairs][16 rows][2]
  int64_t m, m_tiles, k;
  const uint8_t* w;
  int64_t n, row_bytes;
  const float* bias;
  void* y;  // [m, n] float or bf16
};

template <typename Out>
void store_tile(const AmxArgs& a, const float* c, int64_t n0, int64_t m0) {
  // c: 16 weight rows x 16 x rows; y[m0 + j][n0 + i] = c[i][j] (+ bias): column j of c is 16 outputs of row j,
  // so c is transposed in registers (16 gathers cost about as much as the tile's multiplies at K = 576).
  const int64_t rows = std::min<int64_t>(16, a.m - m0), cols = std::min<int64_t>(16, a.n - n0);
  if (cols <= 0) return;  // the zero rows past N in the last pass
  const __mmask16 valid = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(valid, a.bias + n0) : _mm512_setzero_ps();
  __m512 in[16], out[16];
  for (int i = 0; i < 16; ++i) in[i] = _mm512_load_ps(c + 16 * i);
  pagedserve::transpose16(in, out);
  for (int64_t j = 0; j < rows; ++j) {
    const __m512 v = _mm512_add_ps(out[j], bias);
    Out* y = static_cast<Out*>(a.y) + (m0 + j) * a.n + n0;
    if constexpr (std::is_same_v<Out, float>)
      _mm512_mask_storeu_ps(y, valid, v);
    else
      _mm256_mask_storeu_epi16(y, valid, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
}

// x tiles mt (and mt + 1 when Two) against the 32 buffered weight rows starting at n0, over block columns
// kb0 .. kb0 + kc - 1 (the buffer holds just those, kc * 32 bf16 per row). Sums over earlier block columns
// come from cbuf (32 floats per x row: c tiles as stored) unless first; when last the sums go to y, else back
// to cbuf. Stored and reloaded float32 tiles keep the sums exactly as one pass over K would have them.
template <bool Two, typename Out>
void multiply_pass(const AmxArgs& a, const uint16_t* wbuf, int64_t kb0, int64_t kc, bool first, bool last,
                   float* cbuf, int64_t n0, int64_t mt) {
  const int64_t stride = kc * 64;  // bytes between buffered weight rows
  // C tiles of x tile mt in cbuf: weight rows n0.., n0 + 16.. (then mt + 1's); no cbuf when K is one chunk
  float* c0 = cbuf == nullptr ? nullptr : cbuf + mt * 512;
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (Two) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, c0, 64);
    _tile_loadd(1, c0 + 256, 64);
    if constexpr (Two) {
      _tile_loadd(2, c0 + 512, 64);
      _tile_loadd(3, c0 + 768, 64);
    }
  }
  for (int64_t kb = 0; kb < kc; ++kb) {
    _tile_loadd(4, wbuf + 32 * kb, stride);
    _tile_loadd(5, wbuf + 16 * 32 * kc + 32 * kb, stride);
    const uint16_t* b = a.xv + ((kb0 + kb) * a.m_tiles + mt) * 512;
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (Two) {
      _tile_loadd(7, b + 512, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (!last) {
    _tile_stored(0, c0, 64);
    _tile_stored(1, c0 + 256, 64);
    if constexpr (Two) {
      _tile_stored(2, c0 + 512, 64);
      _tile_stored(3, c0 + 768, 64);
    }
    return;
  }
  alignas(64) float c[256];
  _tile_stored(0, c, 64);
  store_tile<Out>(a, c, n0, 16 * mt);
  _tile_stored(1, c, 64);
  store_tile<Out>(a, c, n0 + 16, 16 * mt);
  if constexpr (Two) {
    _tile_stored(2, c, 64);
    store_tile<Out>(a, c, n0, 16 * mt + 16);
    _tile_stored(3, c, 64);
    store_tile<Out>(a, c, n0 + 16, 16 * mt + 16);
  }
}

// For at most two tiles of x (decode batches up to 32 rows) the 32 weight rows are rebuilt one block
// column at a time into a 2 KB buffer (two A tiles) that stays in L1, and multiplied at once: rebuilding
// whole rows first (a 36-98 KB buffer for the embedded model) sends every rebuilt weight through L2 and
// back, which cost as much as the rebuild itself at 16 rows.
template <int64_t T, int MT, typename Out>
void stream_pass(const AmxArgs& a, uint16_t* abuf, int64_t n0) {
  constexpr int64_t B = Format<T>::kBytes;
  const int64_t rows = std::min(kRowsPerPass, a.n - n0);
  if (rows < kRowsPerPass) std::fill(abuf + rows * 32, abuf + kRowsPerPass * 32, 0);
  const uint8_t* w = a.w + n0 * a.row_bytes;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (MT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  alignas(64) float d[32], m[32];
  for (int64_t kb = 0; kb < a.k / 32; ++kb) {
    for (int64_t h = 0; h < 2; ++h)  // block kb's scales of rows 16 h .. 16 h + 15
      decode::scales<T>(w + 16 * h * a.row_bytes + kb * B, std::clamp<int64_t>(rows - 16 * h, 0, 16), d + 16 * h,
                        m + 16 * h, static_cast<int>(a.row_bytes));
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* blk = w + r * a.row_bytes + kb * B;
      // the same block of the next pass's rows: what this thread reads next in this order (0.86-0.94x the
      // time of prefetching 8 KB ahead, which lands mostly in rows this pass already holds)
      _mm_prefetch(reinterpret_cast<const char*>(blk + kRowsPerPass * a.row_bytes), _MM_HINT_T0);
      dequant_block_bf16<T>(blk, d + r, m + r, abuf + r * 32);
    }
    _tile_loadd(4, abuf, 64);
    _tile_loadd(5, abuf + 16 * 32, 64);
    const uint16_t* b = a.xv + kb * a.m_tiles * 512;
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (MT == 2) {
      _tile_loadd(7, b + 512, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[256];
  _tile_stored(0, c, 64);
  store_tile<Out>(a, c, n0, 0);
  _tile_stored(1, c, 64);
  store_tile<Out>(a, c, n0 + 16, 0);
  if constexpr (MT == 2) {
    _tile_stored(2, c, 64);
    store_tile<Out>(a, c, n0, 16);
    _tile_stored(3, c, 64);
    store_tile<Out>(a, c, n0 + 16, 16);
  }
}

template <int64_t T, typename Out>
void amx_gemm_typed(const AmxArgs& a) {
  const int64_t passes = (a.n + kRowsPerPass - 1) / kRowsPerPass;
  at::parallel_for(0, passes, 1, [&](int64_t p0, int64_t p1) {
    const TileConfig cfg;  // tile configuration is per thread
    _tile_loadconfig(&cfg);
    if (a.m_tiles <= 2) {
      alignas(64) uint16_t abuf[kRowsPerPass * 32];
      for (int64_t p = p0; p < p1; ++p)
        a.m_tiles == 1 ? stream_pass<T, 1, Out>(a, abuf, p * kRowsPerPass)
                       : stream_pass<T, 2, Out>(a, abuf, p * kRowsPerPass);
      _tile_release();
      return;
    }
    // K in chunks of at most kMaxChunkBlocks block columns, so the rebuilt rows (A tiles) stay in L1 while
    // every tile of x streams past them from L2; one pass over a long K (down_proj: 98 KB of rebuilt rows)
    // read both operands from L2: 356 GFLOP/s at 352 rows of x against 655 for gate_up (K = 576); in three
    // chunks 0.79-0.89x the time at 64-512 rows (benchmarks/README.md, "The decoder stack in one call").
    const int64_t nb = a.k / 32, chunks = (nb + kMaxChunkBlocks - 1) / kMaxChunkBlocks;
    const int64_t kc_max = (nb + chunks - 1) / chunks;
    std::vector<uint16_t> wbuf(kRowsPerPass * kc_max * 32, 0);
    std::vector<float> cbuf(chunks > 1 ? a.m_tiles * 512 : 0);
    float* const cb = chunks > 1 ? cbuf.data() : nullptr;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kRowsPerPass, rows = std::min(kRowsPerPass, a.n - n0);
      for (int64_t kb0 = 0; kb0 < nb; kb0 += kc_max) {
        const int64_t kc = std::min(kc_max, nb - kb0);
        for (int64_t r = 0; r < rows; ++r)
          dequant_row_bf16<T>(a.w + (n0 + r) * a.row_bytes + kb0 * Format<T>::kBytes, kc, wbuf.data() + r * kc * 32);
        if (rows < kRowsPerPass) std::fill(wbuf.begin() + rows * kc * 32, wbuf.begin() + kRowsPerPass * kc * 32, 0);
        const bool first = kb0 == 0, last = kb0 + kc == nb;
        int64_t mt = 0;
        for (; mt + 1 < a.m_tiles; mt += 2)
          multiply_pass<true, Out>(a, wbuf.data(), kb0, kc, first, last, cb, n0, mt);
        if (mt < a.m_tiles) multiply_pass<false, Out>(a, wbuf.data(), kb0, kc, first, last, cb, n0, mt);
      }
    }
    _tile_release();
  });
}

// x [m, k] bf16 (rows at x_stride) -> B tiles: 32-bit pair p of row r of tile (kb, mt) is x[16 mt + r][32 kb + 2p
// .. + 1]; rows past m are zero.
std::vector<uint16_t> x_tiles(const uint16_t* x, int64_t x_stride, int64_t m, int64_t m_tiles, int64_t k) {
  std::vector<uint16_t> xv(k * m_tiles * 16, 0);
  uint32_t* out = reinterpret_cast<uint32_t*>(xv.data());
  const __m512i pairs = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
  at::parallel_for(0, m, 16, [&](int64_t i0, int64_t i1) {  // rows write disjoint words
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t mt = i / 16, r = i % 16;
      for (int64_t kb = 0; kb < k / 32; ++kb)  // the row's 16 pairs of this block column, 16 pairs apart
        _mm512_i32scatter_epi32(out + (kb * m_tiles + mt) * 256 + r, pairs,
                                _mm512_loadu_si512(x + i * x_stride + 32 * kb), 4);
    }
  });
  return xv;
}

// Rows r0 .. r1 - 1 of w (k features) as bf16 [r1 - r0, k].
at::Tensor dequant_rows_bf16(const at::Tensor& w, int64_t type, int64_t r0, int64_t r1, int64_t k) {
  const int64_t row_bytes = w.size(1);
  at::Tensor out = at::empty({r1 - r0, k}, w.options().dtype(at::kBFloat16));
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const uint8_t* src = w.data_ptr<uint8_t>() + r0 * row_bytes;
  at::parallel_for(0, r1 - r0, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r)
      type == kQ4_1 ? dequant_row_bf16<kQ4_1>(src + r * row_bytes, k / 32, o + r * k)
                    : dequant_row_bf16<kQ8_0>(src + r * row_bytes, k / 32, o + r * k);
  });
  return out;
}

// y = x W^T (+ bias) in bf16 through torch's GEMM, the weight rebuilt kDenseChunk weights at a time.
at::Tensor dense_gemm(const at::Tensor& x, const at::Tensor& w, int64_t type, const at::Tensor& bias, int64_t k) {
  const int64_t n = w.size(0), step = std::max<int64_t>(16, kDenseChunk / k);
  const at::Tensor b = bias.defined() ? bias.to(at::kBFloat16) : at::Tensor();
  if (step >= n) return at::linear(x, dequant_rows_bf16(w, type, 0, n, k), b);
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  for (int64_t r0 = 0; r0 < n; r0 += step) {
    const int64_t r1 = std::min(n, r0 + step);
    y.narrow(1, r0, r1 - r0).copy_(at::linear(x, dequant_rows_bf16(w, type, r0, r1, k),
                                              b.defined() ? b.narrow(0, r0, r1 - r0) : b));
  }
  return y;
}

at::Tensor gemm_gguf_amx(const at::Tensor& x, const at::Tensor& w, int64_t type, const c10::optional<at::Tensor>& bias,
                         c10::optional<at::ScalarType> dtype) {
  constexpr const char* op = "gemm_gguf_amx";
  pagedserve::check_tensor(x, op, "x", at::kBFloat16, 2, pagedserve::Layout::kRows);
  TORCH_CHECK(type == kQ4_1 || type == kQ8_0, op, ": GGML type ", type, " has no AMX kernel; supported: Q4_1 (3), ",
              "Q8_0 (8)");
  const int64_t k = features(w, type, op), n = w.size(0), m = x.size(0);
  TORCH_CHECK(x.size(1) == k, op, ": x has ", x.size(1), " features, the weight's rows hold ", k);
  const at::ScalarType out_type = dtype.value_or(at::kBFloat16);
  TORCH_CHECK(out_type == at::kBFloat16 || out_type == at::kFloat, op, ": dtype must be BFloat16 or Float, got ",
              out_type);
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias must have shape [", n, "], got ", bias->sizes());
    bias32 = bias->to(at::kFloat).contiguous();
    pagedserve::check_tensor(bias32, op, "bias", at::kFloat, 1, pagedserve::Layout::kContiguous);
  }
  if (m >= kDenseRows && out_type == at::kBFloat16 && n > 0) return dense_gemm(x, w, type, bias32, k);
  at::Tensor y = at::empty({m, n}, x.options().dtype(out_type));
  if (m == 0 || n == 0) return y;
  pagedserve::require_tile_state(op);
  const int64_t m_tiles = (m + 15) / 16;
  const std::vector<uint16_t> xv =
      x_tiles(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), m, m_tiles, k);
  const AmxArgs a{xv.data(), m, m_tiles, k, w.data_ptr<uint8_t>(), n, w.size(1),
                  bias32.defined() ? bias32.data_ptr<float>() : nullptr, y.data_ptr()};
  if (type == kQ4_1)
    out_type == at::kFloat ? amx_gemm_typed<kQ4_1, float>(a) : amx_gemm_typed<kQ4_1, c10::BFloat16>(a);
  else
    out_type == at::kFloat ? amx_gemm_typed<kQ8_0, float>(a) : amx_gemm_typed<kQ8_0, c10::BFloat16>(a);
  return y;
}

}  // namespace

PAGEDSERVE_LIBRARY_FRAGMENT(m) {
  m.def("gemm_gguf_amx(Tensor x, Tensor w, int type, Tensor? bias, ScalarType? dtype=None) -> Tensor");
  m.impl("gemm_gguf_amx", c10::DispatchKey::CPU, gemm_gguf_amx);
}

#endif  // PAGEDSERVE_AMX
