// gguf_int8.h's block GEMM for many rows of x (prefill), for the k-quants (Q4_K, Q5_K, Q6_K) and IQ4_XS (kTiles)
// from kMinRows rows.
// gguf_int8.h's driver spends two multiplies per 64 weights (vpmaddubsw, then vpdpwssd by each byte pair's
// scale) and streams all of x past every pair of weight rows. Here:
//   - Each 256-value group of x and of a weight row is reordered so that int32 lane L of all its vectors holds
//     values of one run of 16 (run 16 L .. 16 L + 15 on avx512; on avx2 two sets of 4 vectors, runs 0-7 and
//     8-15): the k-quants' scales are per 16 (Q6_K) or 32 (Q4_K, Q5_K) weights, so one vpdpbusd per 64
//     weights (4 unsigned quants times 4 int8 x into an int32 lane; vpmaddubsw + vpmaddwd without VNNI) sums
//     a whole group into lanes that each belong to one scale, applied once per group in float: d * scale per
//     lane (exact in float32: an f16 times a 6- or 8-bit integer), times dx, plus the offsets times x's sums
//     per 16 as in gguf_int8.h.
//   - As in a blocked float GEMM, x (quantized and reordered once per call) runs in chunks of at most
//     kChunkBytes (in L2) against panels of weight rows of at most kPanelBytes of rebuilt groups (Packed:
//     reordered quants, the 16 float scales and offsets; also in L2), one (chunk, panel) item at a time, the
//     items taken by whichever thread is free; within an item, tiles of kTileX rows of x run against kTileW
//     weight rows at a time (each weight tile against every x tile of the chunk in turn), with kTileW x
//     kTileX int32 and float sums in registers, K in slices of kSliceGroups groups so that a tile's
//     operands stay in L1; a tile's kTileW results per row of x summed across lanes in one tree (hsums).
// Results equal x^ W^T up to float32 rounding (the bound of tests/model/test_gguf_int8.py): the integers are
// exact, each lane's scale one rounding, the additions across lanes and groups in another order than
// gguf_int8.h's driver.
#pragma once

#include "gguf_int8.h"

#if defined(PAGEDSERVE_GGUF_INT8)

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace pagedserve::gguf::int8::tiles {

// From this many rows of x the tiles beat gguf_int8.h's driver (one thread, Llama-1B shapes, weights warm:
// even at 24-32 rows, 1.1-1.5x faster from 48; gguf_int8.h's driver wins below, where rebuilding a weight
// costs more than its dot products with a few rows).
constexpr int64_t kMinRows = 32;
// Register tile: kTileW weight rows x kTileX rows of x (avx512: 12 int32 and 12 float sums of 32 zmm).
constexpr int kTileW = kLanes == 16 ? 4 : 2;
constexpr int kTileX = kLanes == 16 ? 3 : 2;
// Sets of 4 vectors per group (each lane one run of 16 within a set), = kOffsetVecs.
constexpr int kSets = 16 / kLanes;
// Rebuilt groups per panel, reordered x per chunk: both within a Zen 4 / Sapphire Rapids core's L2 (1-2 MB).
constexpr int64_t kPanelBytes = 256 << 10;
constexpr int64_t kChunkBytes = 512 << 10;
// Groups of K per slice (see run_panel)
constexpr int64_t kSliceGroups = 8;
// At least this many rows per chunk of x where K is long (down_proj: 8,192 inputs, 64 rows in kChunkBytes): each
// chunk rebuilds every weight panel again (Llama-1B down_proj at 512 rows: 62 -> 54 CPU ms with 128)
constexpr int64_t kMinChunkRows = 128;
// The types it multiplies: the k-quants, and IQ4_XS (a float scale per 32 under one group: its values + 128 in
// unsigned bytes need VNNI's vpdpbusd, so avx512 / amx builds on CPUs with avx512_vnni)
template <int64_t T>
constexpr bool kTiles = kIntScales<T> || T == kIQ4_XS;

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline IVec iadd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
// out[i] = the sum of v[i]'s lanes, i < 4: one tree for the four (about a third of four hsum()s: at K = 2,048
// the tiles' results are ~10% of their time)
inline void hsums(const FVec* v, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
  // 128-bit lane i: 4 partial sums of v[i]
  __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0,
                                                                                 0, 0, 0, 0, 0), t)));
}
#else
inline IVec iadd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
// out[i] = the sum of v[i]'s lanes, i < 2
inline void hsums(const FVec* v, float* out) {
  const __m256 t = _mm256_hadd_ps(v[0], v[1]);  // [a01 a23 b01 b23 | a45 a67 b45 b67]
  __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  u = _mm_hadd_ps(u, u);
  _mm_storel_pi(reinterpret_cast<__m64*>(out), u);
}
#endif

// s + the sums of 4 products of unsigned w and signed x bytes per int32 lane (w < 128: no int16 saturation)
struct Dot4Plain {
  static inline IVec acc(IVec s, IVec w, IVec x) { return iadd(s, DotPlain::dot4(w, x)); }
};
#if defined(PAGEDSERVE_GGUF_INT8_VNNI)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
struct Dot4Vnni {
  static inline __m512i acc(__m512i s, __m512i w, __m512i x) { return _mm512_dpbusd_epi32(s, w, x); }
};
#pragma GCC pop_options
#endif

// Dword j of a reordered group is dword kOrder[j] of the group in x's order: set a, vector v, lane L holds
// the 4 values 16 (a kLanes + L) + 4 v .. + 3.
struct Order {
  uint8_t src[64];
  constexpr Order() : src() {
    for (int a = 0; a < kSets; ++a)
      for (int v = 0; v < 4; ++v)
        for (int l = 0; l < kLanes; ++l) src[(a * 4 + v) * kLanes + l] = static_cast<uint8_t>(4 * (a * kLanes + l) + v);
  }
};
inline constexpr Order kOrder{};

#if defined(__AVX512F__) && defined(__AVX512BW__)
// vector v of the reordered group: lane L from vector L / 4 of x's order, dword 4 (L % 4) + v (two
// two-register permutes and a blend)
inline void reorder(const __m512i* in, __m512i* out) {
  for (int v = 0; v < 4; ++v) {
    alignas(64) int32_t idx[16];
    for (int l = 0; l < 16; ++l) idx[l] = (l % 8) / 4 * 16 + 4 * (l % 4) + v;
    const __m512i i = _mm512_load_si512(idx);
    out[v] = _mm512_mask_blend_epi32(0xFF00, _mm512_permutex2var_epi32(in[0], i, in[1]),
                                     _mm512_permutex2var_epi32(in[2], i, in[3]));
  }
}
#else
inline void reorder(const __m256i* in, __m256i* out) {
  uint32_t from[64], to[64];
  std::memcpy(from, in, 256);
  for (int j = 0; j < 64; ++j) to[j] = from[kOrder.src[j]];
  std::memcpy(out, to, 256);
}
#endif

inline void reorder(const int8_t* in, int8_t* out) {
  IVec a[kVecs], b[kVecs];
  for (int v = 0; v < kVecs; ++v) a[v] = iload(in + v * kBytes);
  reorder(a, b);
  std::memcpy(out, b, 256);
}

struct Packed {
  IVec q[kVecs];              // quants as unsigned bytes, reordered
  FVec scale[kOffsetVecs];    // per run of 16: d * its integer scale
  FVec offsets[kOffsetVecs];  // per run of 16: the weight of quant 0
};

// Group b of 256 weights (at b) as Packed.
template <int64_t T>
inline void pack(const uint8_t* b, Packed& p) {
  Block u;
  if constexpr (T == kIQ4_XS) rebuild_small<T>(b, 0, 1, u);  // values + 128, offsets -128 d (scale - 32)
  else rebuild<T>(b, u);
  reorder(u.q, p.q);
  alignas(64) float scale[16];
  if constexpr (T == kIQ4_XS) {
    const float d = f16(b);
    for (int j = 0; j < 16; ++j) scale[j] = d * static_cast<float>(iq4xs_scale(j / 2, b));
  } else if constexpr (T == kQ6_K) {
    const float d = f16(b + 208);
    for (int j = 0; j < 16; ++j) scale[j] = d * static_cast<float>(static_cast<int8_t>(b[192 + j]));
  } else {
    // the 8 six-bit scales (ggml's get_scale_min_k4, 4 at a time), each for two runs
    uint32_t s[3], sc[2];
    std::memcpy(s, b + 4, 12);
    sc[0] = s[0] & 0x3f3f3f3f, sc[1] = (s[2] & 0x0f0f0f0f) | (((s[0] >> 6) & 0x03030303) << 4);
    uint8_t bytes[8];
    std::memcpy(bytes, sc, 8);
    const float d = f16(b);
    for (int j = 0; j < 16; ++j) scale[j] = d * static_cast<float>(bytes[j / 2]);
  }
  for (int o = 0; o < kOffsetVecs; ++o) p.scale[o] = fload(scale + o * kLanes), p.offsets[o] = u.offsets[o];
}

// One tile's float sums
struct Sums {
  FVec s[kTileW][kTileX];
};

// Rows n0 .. n0 + rows - 1 of the weight into buf, laid out [row / kTileW][group][row % kTileW]; rows past
// `rows` up to a multiple of kTileW as zeros.
template <int64_t T>
inline void rebuild_panel(const Args& a, int64_t n0, int64_t rows, Packed* buf) {
  constexpr int64_t B = Format<T>::kBytes, E = Format<T>::kElems;
  const int64_t groups = a.x.groups, padded = (rows + kTileW - 1) / kTileW * kTileW;
  for (int64_t j = 0; j < padded; ++j) {
    for (int64_t g = 0; g < groups; ++g) {
      Packed& p = buf[((j / kTileW) * groups + g) * kTileW + j % kTileW];
      if (j < rows) pack<T>(a.w + (n0 + j) * a.row_bytes + g * kGroup / E * B, p);
      else std::memset(static_cast<void*>(&p), 0, sizeof(Packed));
    }
  }
}

// Sums of kTileW rebuilt weight rows (w: [group][kTileW]) times X rows of reordered x from xq (row m0 of
// x's scales and sums) over groups g0 .. g1 - 1, added to sums[i][r] (16 floats each).
template <class Dot, int X>
[[gnu::always_inline]] inline void tile(const Packed* w, const int8_t* xq, const Quantized& x, int64_t m0,
                                        int64_t g0, int64_t g1, FVec (*sums)[kTileX]) {
  FVec sum[kTileW][X];
  for (int i = 0; i < kTileW; ++i)
    for (int r = 0; r < X; ++r) sum[i][r] = sums[i][r];
  w += g0 * kTileW;
  for (int64_t g = g0; g < g1; ++g, w += kTileW) {
    for (int s = 0; s < kSets; ++s) {
      IVec acc[kTileW][X];
      for (int i = 0; i < kTileW; ++i)
        for (int r = 0; r < X; ++r) acc[i][r] = izero();
      for (int v = 4 * s; v < 4 * s + 4; ++v) {
        IVec xv[X];
        for (int r = 0; r < X; ++r) xv[r] = iload(xq + r * x.kpad + g * kGroup + v * kBytes);
        for (int i = 0; i < kTileW; ++i) {
          const IVec q = w[i].q[v];
          for (int r = 0; r < X; ++r) acc[i][r] = Dot::acc(acc[i][r], q, xv[r]);
        }
      }
      for (int r = 0; r < X; ++r) {
        const int64_t at = (m0 + r) * x.groups + g;
        const FVec dx = fset1(x.d[at]), s16 = fload(x.s16 + at * 16 + s * kLanes);
        for (int i = 0; i < kTileW; ++i)
          sum[i][r] = fmadd(w[i].offsets[s], s16, fmadd(fmul(cvt(acc[i][r]), w[i].scale[s]), dx, sum[i][r]));
      }
    }
  }
  for (int i = 0; i < kTileW; ++i)
    for (int r = 0; r < X; ++r) sums[i][r] = sum[i][r];
}

// tile<Dot, xr> for the xr (1 .. X) rows of x left
template <class Dot, int X>
[[gnu::always_inline]] inline void tile_rows(int64_t xr, const Packed* w, const int8_t* xq, const Quantized& x,
                                             int64_t m0, int64_t g0, int64_t g1, FVec (*sums)[kTileX]) {
  if (xr == X) return tile<Dot, X>(w, xq, x, m0, g0, g1, sums);
  if constexpr (X > 1) tile_rows<Dot, X - 1>(xr, w, xq, x, m0, g0, g1, sums);
}

// Rows m0 .. m1 - 1 of y, columns n0 .. n0 + rows - 1, from the rebuilt panel; xq: reordered x from row m0.
// K in even slices of at most kSliceGroups groups, so that a tile's weights and x stay in L1; between slices
// each tile's float sums wait in `sums` ([x tile][weight tile][kTileW][kTileX] vectors).
template <class Dot, typename Out>
[[gnu::always_inline]] inline void run_panel(const Args& a, const int8_t* xq, int64_t m0, int64_t m1, int64_t n0,
                                             int64_t rows, const Packed* buf, FVec (*sums)[kTileX]) {
  const int64_t groups = a.x.groups, wtiles = (rows + kTileW - 1) / kTileW;
  const int64_t slices = (groups + kSliceGroups - 1) / kSliceGroups, slice = (groups + slices - 1) / slices;
  for (int64_t g0 = 0; g0 < groups; g0 += slice) {
    const int64_t g1 = std::min(groups, g0 + slice);
    // always inline: run_vnni's target (VNNI) reaches the dot products only through inlined code
    const auto step = [&](int64_t m, int64_t j) __attribute__((always_inline)) {
      const int64_t xr = std::min<int64_t>(kTileX, m1 - m);
      FVec (*s)[kTileX] = sums + (((m - m0) / kTileX) * wtiles + j / kTileW) * kTileW;
      if (g0 == 0)
        for (int i = 0; i < kTileW; ++i)
          for (int r = 0; r < kTileX; ++r) s[i][r] = fset1(0.f);
      tile_rows<Dot, kTileX>(xr, buf + j * groups, xq + (m - m0) * a.x.kpad, a.x, m, g0, g1, s);
      if (g1 < groups) return;
      const int64_t wr = std::min<int64_t>(kTileW, rows - j);
      for (int64_t r = 0; r < xr; ++r) {
        Out* y = static_cast<Out*>(a.y) + (m + r) * a.n + n0 + j;
        FVec v[kTileW];
        alignas(16) float sum[kTileW];
        for (int i = 0; i < kTileW; ++i) v[i] = s[i][r];
        hsums(v, sum);
        for (int64_t i = 0; i < wr; ++i) y[i] = static_cast<Out>(sum[i] + (a.bias ? a.bias[n0 + j + i] : 0.f));
      }
    };
    // weight tiles outside: a tile's rebuilt weights (kTileW x 384 B a group) stay in L1 while x's rows (256 B a
    // group) stream past from L2, half the L2 traffic of the other order (Llama-1B gate_up at 512 rows, 1
    // thread: 137 -> 98 CPU ms with hsums)
    for (int64_t j = 0; j < rows; j += kTileW)
      for (int64_t m = m0; m < m1; m += kTileX) step(m, j);
  }
}

// Work items (chunk of rows of x, panel of weight rows), chunk after chunk, each taken by whichever thread
// is free (on a busy machine a thread may lose its core for a while: no static split waits for it).
struct Work {
  const int8_t* xq;  // x reordered, all rows
  int64_t chunk, panel_rows, panels, items;
  std::atomic<int64_t>* next;
};

template <int64_t T, class Dot, typename Out>
[[gnu::always_inline]] inline void run(const Args& a, const Work& w, Packed* buf, FVec (*sums)[kTileX]) {
  for (int64_t i; (i = w.next->fetch_add(1, std::memory_order_relaxed)) < w.items;) {
    const int64_t m0 = i / w.panels * w.chunk, m1 = std::min(a.m, m0 + w.chunk);
    const int64_t n0 = i % w.panels * w.panel_rows, rows = std::min(w.panel_rows, a.n - n0);
    rebuild_panel<T>(a, n0, rows, buf);
    run_panel<Dot, Out>(a, w.xq + m0 * a.x.kpad, m0, m1, n0, rows, buf, sums);
  }
}

// The thread's work in functions of their own: VNNI's dot products inline only into code compiled for it.
template <int64_t T, typename Out>
[[gnu::noinline]] void run_plain(const Args& a, const Work& w, Packed* buf, FVec (*sums)[kTileX]) {
  run<T, Dot4Plain, Out>(a, w, buf, sums);
}

#if defined(PAGEDSERVE_GGUF_INT8_VNNI)
template <int64_t T, typename Out>
[[gnu::noinline, gnu::target("avx512vnni")]] void run_vnni(const Args& a, const Work& w, Packed* buf,
                                                           FVec (*sums)[kTileX]) {
  run<T, Dot4Vnni, Out>(a, w, buf, sums);
}
#endif

// y = x^ W^T (+ bias) for the k-quants (see the top of this file).
template <int64_t T, typename Out>
void gemm(const Args& a, bool vnni) {
  static_assert(kTiles<T>);
  TORCH_CHECK(vnni || !kNeedsVnni<T>, "gemm_gguf_int8: GGML type ", T, " needs AVX512-VNNI");
  const Quantized& x = a.x;
  std::vector<int8_t> xbuf(a.m * x.kpad + 64);
  int8_t* xq = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(xbuf.data()) + 63) & ~uintptr_t{63});
  at::parallel_for(0, a.m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < x.groups; ++g) reorder(x.q + r * x.kpad + g * kGroup, xq + r * x.kpad + g * kGroup);
  });
  // chunks of x within kChunkBytes (or of kMinChunkRows rows); panels within kPanelBytes, at least 4 per thread
  // where the weight has the rows
  const int64_t most = std::max<int64_t>(kMinChunkRows, kChunkBytes / x.kpad), chunks = (a.m + most - 1) / most;
  const int64_t chunk = ((a.m + chunks - 1) / chunks + kTileX - 1) / kTileX * kTileX;  // even chunks
  const int64_t threads = at::get_num_threads();
  const int64_t row_bytes = static_cast<int64_t>(sizeof(Packed)) * x.groups;  // rebuilt
  int64_t panel_rows = std::max<int64_t>(kTileW, kPanelBytes / row_bytes / kTileW * kTileW);
  const int64_t spread = ((a.n + 4 * threads - 1) / (4 * threads) + kTileW - 1) / kTileW * kTileW;
  panel_rows = std::min(panel_rows, std::max<int64_t>(kTileW, spread));
  const int64_t panels = (a.n + panel_rows - 1) / panel_rows;
  std::atomic<int64_t> next{0};
  const Work w{xq, chunk, panel_rows, panels, (a.m + chunk - 1) / chunk * panels, &next};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::unique_ptr<Packed[]> buf(new Packed[panel_rows * x.groups]);
    std::unique_ptr<Sums[]> sums(new Sums[(std::min(chunk, a.m) + kTileX - 1) / kTileX * (panel_rows / kTileW)]);
    FVec(*s)[kTileX] = reinterpret_cast<FVec(*)[kTileX]>(sums.get());
#if defined(PAGEDSERVE_GGUF_INT8_VNNI)
    if (vnni) return run_vnni<T, Out>(a, w, buf.get(), s);
#endif
    if constexpr (!kNeedsVnni<T>) run_plain<T, Out>(a, w, buf.get(), s);
  });
}

}  // namespace pagedserve::gguf::int8::tiles

#endif
