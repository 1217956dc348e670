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
#include "attention_avx512.h"
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
