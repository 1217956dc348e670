// One attention work item: a tile of up to 16 query tokens of one sequence x the query heads of
// `kv_heads` consecutive kv heads, against that sequence's cached keys, read in place through its block
// table (see paged_attention.cpp). Rows are ordered (kv head, token, head in group):
//   row r = (h * n_q + i) * group + g   ->  query head (kv_head0 + h) * group + g of token i
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedserve {

struct Tile {
  const float* q;          // query row of (token 0 of the tile, first query head of the first kv head)
  int64_t q_tok_stride, q_head_stride;
  float* out;              // same layout as q
  int64_t o_tok_stride, o_head_stride;
  const float* k_cache;    // the first kv head's first element in slot 0
  const float* v_cache;
  int64_t slot_stride;     // floats between consecutive slots (num_kv_heads * head_dim)
  const int64_t* table;    // the sequence's block table
  int64_t block_size, head_dim, group, kv_heads;
  int64_t pos0, n_q;       // position of the tile's first query token, number of tokens
  float scale;
};

constexpr float kMinScore = -std::numeric_limits<float>::max();  // finite: built with -ffast-math

inline int64_t rows_per_head(const Tile& t) { return t.n_q * t.group; }

inline void load_queries(const Tile& t, float* q) {
  for (int64_t h = 0; h < t.kv_heads; ++h)
    for (int64_t i = 0; i < t.n_q; ++i)
      for (int64_t g = 0; g < t.group; ++g) {
        const float* src = t.q + i * t.q_tok_stride + (h * t.group + g) * t.q_head_stride;
        float* dst = q + ((h * t.n_q + i) * t.group + g) * t.head_dim;
        for (int64_t d = 0; d < t.head_dim; ++d) dst[d] = src[d] * t.scale;
      }
}

inline void store_outputs(const Tile& t, const float* acc, const float* l) {
  for (int64_t h = 0; h < t.kv_heads; ++h)
    for (int64_t i = 0; i < t.n_q; ++i)
      for (int64_t g = 0; g < t.group; ++g) {
        const int64_t r = (h * t.n_q + i) * t.group + g;
        const float inv = 1.f / l[r];
        float* dst = t.out + i * t.o_tok_stride + (h * t.group + g) * t.o_head_stride;
        for (int64_t d = 0; d < t.head_dim; ++d) dst[d] = acc[r * t.head_dim + d] * inv;
      }
}

// Portable path: plain loops the compiler vectorizes; any head_dim, any block size.
inline void attend_tile_generic(const Tile& t, std::vector<float>& scratch) {
  const int64_t hd = t.head_dim, rows = rows_per_head(t) * t.kv_heads, bs = t.block_size;
  scratch.assign(rows * hd * 2 + rows * bs + rows * 2, 0.f);
  float* q = scratch.data();
  float* acc = q + rows * hd;
  float* s = acc + rows * hd;
  float* m = s + rows * bs;
  float* l = m + rows;
  load_queries(t, q);
  std::fill(m, m + rows, kMinScore);
  const int64_t last_pos = t.pos0 + t.n_q - 1;
  for (int64_t b = 0; b <= last_pos / bs; ++b) {
    const float* kb = t.k_cache + t.table[b] * bs * t.slot_stride;
    const float* vb = t.v_cache + t.table[b] * bs * t.slot_stride;
    const int64_t kp0 = b * bs;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t limit = std::min(bs, t.pos0 + (r / t.group) % t.n_q + 1 - kp0);  // visible keys [0, limit)
      if (limit <= 0) continue;
      const int64_t head_off = r / rows_per_head(t) * hd;
      float* sr = s + r * bs;
      const float* qr = q + r * hd;
      float bmax = kMinScore;
      for (int64_t j = 0; j < limit; ++j) {
        const float* kj = kb + j * t.slot_stride + head_off;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < hd; ++d) dot += qr[d] * kj[d];
        sr[j] = dot;
        bmax = std::max(bmax, dot);
      }
      const float m_new = std::max(m[r], bmax);
      const float corr = std::exp(m[r] - m_new);  // underflows to 0 on the first block
      float sum = 0.f;
      for (int64_t j = 0; j < limit; ++j) sum += (sr[j] = std::exp(sr[j] - m_new));
      l[r] = l[r] * corr + sum;
      m[r] = m_new;
      float* ar = acc + r * hd;
      for (int64_t d = 0; d < hd; ++d) ar[d] *= corr;
      for (int64_t j = 0; j < limit; ++j) {
        const float* vj = vb + j * t.slot_stride + head_off;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) ar[d] += sr[j] * vj[d];
      }
    }
  }
  store_outputs(t, acc, l);
}

#if defined(__AVX512F__)
// AVX-512 path for head_dim = 16 * NV. Keys go 16 at a time (one sub-block): the 16 x head_dim key slab
// is transposed once so that each query row's 16 scores are head_dim broadcast-FMAs with no horizontal
// sums; then p = exp(s - m) for 16 keys in one vector, and P x V accumulates rows in registers.

inline __m512 exp512(__m512 x) {
  // Cephes expf: exp(x) = 2^n * e^r, n = round(x / ln 2), |r| <= ln2 / 2, degree-5 polynomial for e^r.
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// in: 16 rows of 16 floats; out[c] = column c.
inline void transpose16(const __m512* in, __m512* out) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), y0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 x1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    out[c] = _mm512_shuffle_f32x4(x0, x1, 0x88);
    out[8 + c] = _mm512_shuffle_f32x4(x0, x1, 0xDD);
    out[4 + c] = _mm512_shuffle_f32x4(y0, y1, 0x88);
    out[12 + c] = _mm512_shuffle_f32x4(y0, y1, 0xDD);
  }
}

// acc rows r0.. r0+NR-1 (in memory) = acc * corr + P x V over nk keys, in registers.
template <int NR, int NV>
inline void accumulate_pv(float* acc, const float* p, const float* corr, const float* vb, int64_t slot_stride,
                          int64_t nk) {
  __m512 a[NR][NV];
  for (int r = 0; r < NR; ++r) {
    const __m512 c = _mm512_set1_ps(corr[r]);
    for (int v = 0; v < NV; ++v) a[r][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * 16 * NV + 16 * v), c);
  }
  for (int64_t j = 0; j < nk; ++j) {
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = _mm512_loadu_ps(vb + j * slot_stride + 16 * v);
    for (int r = 0; r < NR; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * 16 + j]);
      for (int v = 0; v < NV; ++v) a[r][v] = _mm512_fmadd_ps(pj, vv[v], a[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + r * 16 * NV + 16 * v, a[r][v]);
}

template <int NV>
void attend_tile_avx512(const Tile& t, std::vector<float>& scratch) {
  constexpr int D = 16 * NV;
  constexpr int RC = NV <= 4 ? 6 : 3;  // rows per register chunk: RC * NV accumulators + NV values
  const int64_t rph = rows_per_head(t), rows = rph * t.kv_heads, bs = t.block_size;
  scratch.assign(D * 16 + 16 + rows * D * 2 + rows * 2 + RC * 16 + RC, 0.f);
  // kt: [D][16] transposed keys of the current sub-block, 64-byte aligned for aligned loads.
  float* kt = scratch.data() + (16 - (reinterpret_cast<uintptr_t>(scratch.data()) / sizeof(float)) % 16) % 16;
  float* q = kt + D * 16;
  float* acc = q + rows * D;
  float* m = acc + rows * D;
  float* l = m + rows;
  float* p = l + rows;         // [RC][16] probabilities of the current row chunk
  float* corr = p + RC * 16;   // [RC]
  load_queries(t, q);
  std::fill(m, m + rows, kMinScore);
  const int64_t last_pos = t.pos0 + t.n_q - 1;
  __m512 slab[16], cols[16];
  for (int64_t kp0 = 0; kp0 <= last_pos; kp0 += std::min<int64_t>(16, bs - kp0 % bs)) {
    // Sub-block: keys kp0 .. kp0+nk-1, all inside one block.
    const int64_t nk = std::min<int64_t>({16, bs - kp0 % bs, last_pos + 1 - kp0});
    const int64_t slot0 = t.table[kp0 / bs] * bs + kp0 % bs;
    const float* kb = t.k_cache + slot0 * t.slot_stride;
    const float* vb = t.v_cache + slot0 * t.slot_stride;
    // Blocks are scattered, so the hardware prefetcher cannot follow; fetch the next sub-block now.
    const int64_t next = kp0 + nk;
    if (next <= last_pos) {
      const int64_t nslot = t.table[next / bs] * bs + next % bs;
      const int64_t nn = std::min<int64_t>({16, bs - next % bs, last_pos + 1 - next});
      for (int64_t j = 0; j < nn; ++j)
        for (int64_t c = 0; c < t.kv_heads * D; c += 16) {
          _mm_prefetch(reinterpret_cast<const char*>(t.k_cache + (nslot + j) * t.slot_stride + c), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(t.v_cache + (nslot + j) * t.slot_stride + c), _MM_HINT_T0);
        }
    }
    for (int64_t h = 0; h < t.kv_heads; ++h) {
    for (int v = 0; v < NV; ++v) {
      for (int j = 0; j < 16; ++j)
        slab[j] = j < nk ? _mm512_loadu_ps(kb + h * D + j * t.slot_stride + 16 * v) : _mm512_setzero_ps();
      transpose16(slab, cols);
      for (int c = 0; c < 16; ++c) _mm512_store_ps(kt + (16 * v + c) * 16, cols[c]);
    }
    const float* vh = vb + h * D;
    for (int64_t r0 = h * rph; r0 < (h + 1) * rph; r0 += RC) {
      const int nr = static_cast<int>(std::min<int64_t>(RC, (h + 1) * rph - r0));
      for (int r = 0; r < nr; ++r) {
        const int64_t row = r0 + r;
        const int64_t limit = std::min(nk, t.pos0 + (row / t.group) % t.n_q + 1 - kp0);
        const float* qr = q + row * D;
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 2) {
          s0 = _mm512_fmadd_ps(_mm512_set1_ps(qr[d]), _mm512_load_ps(kt + d * 16), s0);
          s1 = _mm512_fmadd_ps(_mm512_set1_ps(qr[d + 1]), _mm512_load_ps(kt + (d + 1) * 16), s1);
        }
        const __mmask16 mask = limit <= 0 ? 0 : static_cast<__mmask16>((1u << limit) - 1u);
        const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(kMinScore), mask, _mm512_add_ps(s0, s1));
        if (mask == 0) {
          corr[r] = 1.f;
          _mm512_storeu_ps(p + r * 16, _mm512_setzero_ps());
          continue;
        }
        const float m_new = std::max(m[row], _mm512_reduce_max_ps(s));
        const __m512 e = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
        corr[r] = std::exp(m[row] - m_new);
        l[row] = l[row] * corr[r] + _mm512_reduce_add_ps(e);
        m[row] = m_new;
        _mm512_storeu_ps(p + r * 16, e);
      }
      float* a = acc + r0 * D;
      if constexpr (RC == 6) {
        switch (nr) {
          case 6: accumulate_pv<6, NV>(a, p, corr, vh, t.slot_stride, nk); break;
          case 5: accumulate_pv<5, NV>(a, p, corr, vh, t.slot_stride, nk); break;
          case 4: accumulate_pv<4, NV>(a, p, corr, vh, t.slot_stride, nk); break;
          case 3: accumulate_pv<3, NV>(a, p, corr, vh, t.slot_stride, nk); break;
          case 2: accumulate_pv<2, NV>(a, p, corr, vh, t.slot_stride, nk); break;
          default: accumulate_pv<1, NV>(a, p, corr, vh, t.slot_stride, nk); break;
        }
      } else {
        switch (nr) {
          case 3: accumulate_pv<3, NV>(a, p, corr, vh, t.slot_stride, nk); break;
          case 2: accumulate_pv<2, NV>(a, p, corr, vh, t.slot_stride, nk); break;
          default: accumulate_pv<1, NV>(a, p, corr, vh, t.slot_stride, nk); break;
        }
      }
    }
    }  // kv heads
  }
  store_outputs(t, acc, l);
}
#endif

inline void attend_tile(const Tile& t, std::vector<float>& scratch) {
#if defined(__AVX512F__)
  switch (t.head_dim) {
    case 64: return attend_tile_avx512<4>(t, scratch);
    case 128: return attend_tile_avx512<8>(t, scratch);
    case 32: return attend_tile_avx512<2>(t, scratch);
    case 96: return attend_tile_avx512<6>(t, scratch);
    default: break;
  }
#endif
  attend_tile_generic(t, scratch);
}

}  // namespace pagedserve
