// One attention work item: a tile of up to 16 query tokens of one sequence x the query heads of
// `kv_heads` consecutive kv heads, against that sequence's cached keys, read in place through its block
// table (see paged_attention.cpp). Rows are ordered (kv head, token, head in group):
//   row r = (h * n_q + i) * group + g   ->  query head (kv_head0 + h) * group + g of token i
// Queries and outputs are float32 or bf16 (QT); the cache is float32, bf16, int8 or fp8 e4m3 (CT,
// kv_types.h). The arithmetic is float32 throughout: queries are converted once per tile; the portable path
// reads a float32 cache in place and converts other cache types a block at a time, all of the tile's kv
// heads, into a small buffer that stays in L1 while every row of the tile reads it (kv_rows); the AVX-512
// path converts in registers where it can (attention_avx512.h). Both prefetch two blocks ahead. In the amx
// variant, tiles of bf16 queries with more than 4 rows per kv head (prefill) multiply on AMX tiles instead
// (attention_amx.h): bf16 products, float32 sums and softmax.
//
// A tile may walk only part of the keys, [key_begin, key_end), and leave a partial result: its float32
// outputs and each row's log-sum-exp (m + log l), which the caller merges with the other parts of the same
// rows (paged_attention.cpp: decode sequences that share their leading blocks read them once, together).
//
// A batch-invariant tile (`invariant`) computes each row exactly as a one-token tile of the same row would, so
// that a token's output does not depend on how many tokens share its tile (decode, k + 1 verified speculative
// tokens, a prefill chunk of any length): plain tiles take the AVX-512 direct path at every size (never the
// transposed or AMX paths, which sum a row's scores in another order; capped ones too, capping each score),
// windowed tiles the portable path (never the decode tile's sub-block walk). Both walk a row's keys in the same sub-blocks in the same
// order whatever the tile; keys past a row's position contribute exact zeros (p = 0, correction 1).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "amx_state.h"
#include "kv_types.h"
#include "simd_transpose.h"

namespace pagedserve {

struct Tile {
  const void* q;            // query row of (token 0 of the tile, first query head of the first kv head)
  int64_t q_tok_stride, q_head_stride;  // in elements
  void* out;                // same layout and type as q
  int64_t o_tok_stride, o_head_stride;
  const uint8_t* k_cache;   // the first kv head's row in slot 0
  const uint8_t* v_cache;
  int64_t slot_bytes;       // bytes between consecutive slots (num_kv_heads rows)
  int64_t row_bytes;        // bytes between a slot's consecutive kv heads
  const int64_t* table;     // the sequence's block table
  int64_t block_size, head_dim, group, kv_heads;
  int64_t pos0, n_q;        // position of the tile's first query token, number of tokens
  float scale;
  int64_t key_begin = 0;    // the keys walked, [key_begin, key_end): key_begin is a block's first position
                            // (any position in a windowed decode tile on the AVX-512 path),
  int64_t key_end = 0;      // key_end at most pos0 + n_q (every key a row may see: causal)
  int64_t window = 0;       // > 0: the row at position p sees keys p - window + 1 .. p only (sliding window)
  float softcap = 0.f;      // > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
  bool invariant = false;   // batch-invariant: every row reduces its keys as a one-token tile would (below)
  float* part = nullptr;    // when set: float32 outputs go here (o_*_stride apart) instead of out,
  float* lse = nullptr;     // and each row's log-sum-exp here (lse_tok_stride per token, 1 per head)
  int64_t lse_tok_stride = 0;
};

// Per-thread buffers, reused across the thread's work items.
struct TileScratch {
  std::vector<float> io;    // the tile's scaled queries, then its outputs: rows x head_dim each
  std::vector<float> work;  // the kernel's own buffers
};

constexpr float kMinScore = -std::numeric_limits<float>::max();  // finite: built with -ffast-math

inline int64_t rows_per_head(const Tile& t) { return t.n_q * t.group; }

inline int64_t last_key(const Tile& t) { return t.key_end - 1; }

// The first key a tile's rows may see: key_begin, or with a window its first row's first visible key.
inline int64_t first_key(const Tile& t) {
  return t.window > 0 ? std::max(t.key_begin, t.pos0 - t.window + 1) : t.key_begin;
}

template <typename QT>
inline void load_queries(const Tile& t, float* q) {
  const QT* base = static_cast<const QT*>(t.q);
  for (int64_t h = 0; h < t.kv_heads; ++h)
    for (int64_t i = 0; i < t.n_q; ++i)
      for (int64_t g = 0; g < t.group; ++g) {
        const QT* src = base + i * t.q_tok_stride + (h * t.group + g) * t.q_head_stride;
        float* dst = q + ((h * t.n_q + i) * t.group + g) * t.head_dim;
        for (int64_t d = 0; d < t.head_dim; ++d) dst[d] = to_float(src[d]) * t.scale;
      }
}

// The tile's output rows o (and, for a partial tile, their log-sum-exps) to out, or to part and lse.
template <typename QT>
inline void store_outputs(const Tile& t, const float* o, const float* lse) {
  for (int64_t h = 0; h < t.kv_heads; ++h)
    for (int64_t i = 0; i < t.n_q; ++i)
      for (int64_t g = 0; g < t.group; ++g) {
        const int64_t row = (h * t.n_q + i) * t.group + g;
        const int64_t at = i * t.o_tok_stride + (h * t.group + g) * t.o_head_stride;
        const float* src = o + row * t.head_dim;
        if (t.part != nullptr) {
          std::copy(src, src + t.head_dim, t.part + at);
          t.lse[i * t.lse_tok_stride + h * t.group + g] = lse[row];
          continue;
        }
        QT* dst = static_cast<QT*>(t.out) + at;
        for (int64_t d = 0; d < t.head_dim; ++d) dst[d] = from_float<QT>(src[d]);
      }
}

// o = acc / l per row, and when lse is set, each row's log-sum-exp m + log l (a row that saw no key has l = 0:
// its lse is kMinScore, so that a merge gives it no weight).
inline void normalize_rows(const float* acc, const float* m, const float* l, int64_t rows, int64_t hd, float* o,
                           float* lse) {
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t d = 0; d < hd; ++d) o[r * hd + d] = acc[r * hd + d] * inv;
    if (lse != nullptr) lse[r] = l[r] > 0.f ? m[r] + std::log(l[r]) : kMinScore;
  }
}

// The keys (or values) of slots slot0 .. slot0+n-1, the tile's kv heads, as float32: head h of slot
// slot0 + j is at result + j * stride + h * head_dim. A float32 cache is read in place; other types are
// converted into buf (n * kv_heads * head_dim floats).
template <typename CT>
inline const float* kv_rows(const Tile& t, const uint8_t* cache, int64_t slot0, int64_t n, float* buf,
                            int64_t& stride) {
  const uint8_t* base = cache + slot0 * t.slot_bytes;
  if constexpr (std::is_same_v<CT, float>) {
    stride = t.slot_bytes / static_cast<int64_t>(sizeof(float));
    return reinterpret_cast<const float*>(base);
  } else {
    stride = t.kv_heads * t.head_dim;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t h = 0; h < t.kv_heads; ++h)
        load_row<CT>(base + j * t.slot_bytes + h * t.row_bytes, t.head_dim, buf + j * stride + h * t.head_dim);
    return buf;
  }
}

// How many blocks ahead of the one being attended prefetch_ahead requests (1 to 4 measured alike, cold).
constexpr int64_t kPrefetchBlocks = 2;

// Requests block b's K and V rows (the tile's kv heads, its slots up to last_pos) into L2 (locality 2:
// prefetcht1 on x86; into L1 measured no faster).
inline void prefetch_block(const Tile& t, int64_t b, int64_t last_pos) {
  const int64_t kp = b * t.block_size;
  if (kp > last_pos) return;
  const int64_t n = std::min(t.block_size, last_pos + 1 - kp), width = t.kv_heads * t.row_bytes;
  const bool whole = width == t.slot_bytes;  // all heads: the block's rows are one contiguous span
  const int64_t spans = whole ? 1 : n, span = whole ? n * width : width;
  const int64_t slot0 = t.table[b] * t.block_size;
  for (const uint8_t* cache : {t.k_cache, t.v_cache})
    for (int64_t j = 0; j < spans; ++j) {
      const uintptr_t begin = reinterpret_cast<uintptr_t>(cache + (slot0 + j) * t.slot_bytes);
      for (uintptr_t line = begin & ~uintptr_t{63}; line < begin + span; line += 64)
        __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
    }
}

// The decode path's prefetch: one slot's K and V rows of one kv head (at byte offset `at` in both caches),
// requested as the kernel reads the row kPrefetchBlocks blocks before it. A whole block requested at once
// (prefetch_block, 12 KB for the embedded model's 3 kv heads) queues ~200 requests behind the core's few
// line-fill buffers; a few per row read keep memory busy without stalling the arithmetic.
inline void prefetch_rows(const Tile& t, int64_t at) {
  for (const uint8_t* cache : {t.k_cache, t.v_cache}) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(cache + at);
    for (uintptr_t line = begin & ~uintptr_t{63}; line < begin + t.row_bytes; line += 64)
      __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
  }
}

// Called as the tile reaches block b (first: the walk's first block). Blocks are scattered, so the hardware
// prefetcher cannot follow a sequence from one block to the next, and in decode the cache is cold (the step's
// weights evicted it since the previous layer read it): without requests this far ahead the kernel waits on memory
// latency instead of streaming. The walk's first block is read on demand; the next ones are requested together.
inline void prefetch_ahead(const Tile& t, int64_t b, int64_t last_pos) {
  if (b == first_key(t) / t.block_size)
    for (int64_t i = 1; i < kPrefetchBlocks; ++i) prefetch_block(t, b + i, last_pos);
  prefetch_block(t, b + kPrefetchBlocks, last_pos);
}

// Portable path: plain loops the compiler vectorizes; any head_dim, any block size; the path of head sizes the
// AVX-512 path has no variant for, of batch-invariant windowed tiles, and without AVX-512 of every tile. q: the tile's scaled
// query rows; o: receives its output rows (lse, when set, their log-sum-exps).
template <typename CT>
inline void attend_rows_generic(const Tile& t, const float* q, float* o, float* lse, std::vector<float>& scratch) {
  const int64_t hd = t.head_dim, rows = rows_per_head(t) * t.kv_heads, bs = t.block_size;
  const int64_t kv_buf = std::is_same_v<CT, float> ? 0 : bs * t.kv_heads * hd;
  scratch.assign(rows * hd + rows * bs + rows * 2 + 2 * kv_buf, 0.f);
  float* acc = scratch.data();
  float* s = acc + rows * hd;
  float* m = s + rows * bs;
  float* l = m + rows;
  float* k_buf = l + rows;
  float* v_buf = k_buf + kv_buf;
  std::fill(m, m + rows, kMinScore);
  const int64_t last_pos = last_key(t);
  for (int64_t b = first_key(t) / bs; b <= last_pos / bs; ++b) {
    const int64_t kp0 = b * bs, n = std::min(bs, last_pos + 1 - kp0);
    prefetch_ahead(t, b, last_pos);
    int64_t ks, vs;
    const float* kb = kv_rows<CT>(t, t.k_cache, t.table[b] * bs, n, k_buf, ks);
    const float* vb = kv_rows<CT>(t, t.v_cache, t.table[b] * bs, n, v_buf, vs);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = t.pos0 + (r / t.group) % t.n_q;
      const int64_t limit = std::min(n, pos + 1 - kp0);  // visible keys [lo, limit)
      const int64_t lo = t.window > 0 ? std::max<int64_t>(0, pos - t.window + 1 - kp0) : 0;
      if (limit <= lo) continue;
      const int64_t head_off = r / rows_per_head(t) * hd;
      float* sr = s + r * bs;
      const float* qr = q + r * hd;
      float bmax = kMinScore;
      for (int64_t j = lo; j < limit; ++j) {
        const float* kj = kb + j * ks + head_off;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < hd; ++d) dot += qr[d] * kj[d];
        if (t.softcap > 0.f) dot = t.softcap * std::tanh(dot / t.softcap);
        sr[j] = dot;
        bmax = std::max(bmax, dot);
      }
      const float m_new = std::max(m[r], bmax);
      const float corr = std::exp(m[r] - m_new);  // underflows to 0 on the first block
      float sum = 0.f;
      for (int64_t j = lo; j < limit; ++j) sum += (sr[j] = std::exp(sr[j] - m_new));
      l[r] = l[r] * corr + sum;
      m[r] = m_new;
      float* ar = acc + r * hd;
      for (int64_t d = 0; d < hd; ++d) ar[d] *= corr;
      for (int64_t j = lo; j < limit; ++j) {
        const float* vj = vb + j * vs + head_off;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) ar[d] += sr[j] * vj[d];
      }
    }
  }
  normalize_rows(acc, m, l, rows, hd, o, lse);
}

#if defined(__AVX512F__)
#include "attention_avx512.h"
#endif
#if defined(PAGEDSERVE_AMX)
#include "attention_amx.h"
#endif

template <typename CT>
inline void attend_rows(const Tile& t, const float* q, float* o, float* lse, std::vector<float>& scratch) {
#if defined(__AVX512F__)
  // A windowed tile walks from its first row's first visible key, which need not start a block (the AVX-512 path
  // reads sub-blocks from any position), and masks each row's keys before its own window (window_start), so a
  // windowed prefill tile runs the transposed path as a plain one does. Soft-capped scores are capped in
  // registers (softcap512). Batch-invariant windowed tiles keep the portable path: a row's sub-blocks would
  // start at its tile's first row's window, so its sums would depend on the tile.
  if (t.window == 0 || !t.invariant) {
    Tile u = t;
    u.key_begin = first_key(t);
    switch (u.head_dim) {
      case 64: return attend_rows_avx512<4, CT>(u, q, o, lse, scratch);
      case 128: return attend_rows_avx512<8, CT>(u, q, o, lse, scratch);
      case 32: return attend_rows_avx512<2, CT>(u, q, o, lse, scratch);
      case 96: return attend_rows_avx512<6, CT>(u, q, o, lse, scratch);
      case 256: return attend_rows_avx512<16, CT>(u, q, o, lse, scratch);
      default: break;
    }
  }
#endif
  attend_rows_generic<CT>(t, q, o, lse, scratch);
}

template <typename QT, typename CT>
inline void attend_tile(const Tile& t, TileScratch& scratch) {
  const int64_t rows = rows_per_head(t) * t.kv_heads, n = rows * t.head_dim;
  scratch.io.resize(2 * n + rows);
  float* q = scratch.io.data();
  float* o = q + n;
  float* lse = t.part != nullptr ? o + n : nullptr;
#if defined(PAGEDSERVE_AMX)
  if constexpr (amx_types_v<QT, CT>) {
    if (amx_applies(t) && t.window == 0 && t.softcap == 0.f && !t.invariant) {
      attend_tile_amx<CT>(t, o, lse, scratch.work);
      store_outputs<QT>(t, o, lse);
      return;
    }
  }
#endif
  load_queries<QT>(t, q);
  attend_rows<CT>(t, q, o, lse, scratch.work);
  store_outputs<QT>(t, o, lse);
}

}  // namespace pagedserve
