// AVX-512 tile for head_dim = 16 * NV. Included by attention_tile.h, inside namespace pagedserve, only
// when the compiler targets AVX-512 (the avx512 variant; pagedserve/kernels/isa.py). transpose16 comes from
// simd_transpose.h, which attention_tile.h includes first.
#pragma once

// Keys go 16 at a time (one sub-block, inside one block); p = exp(s - m) for 16 keys in one vector, and
// P x V accumulates rows in registers. Two shapes:
// - many rows per kv head (prefill tiles): the sub-block's keys and values are converted into float32
//   buffers (kv_rows) that every row chunk reads, and each head's 16 x head_dim key slab is transposed once,
//   so that each query row's 16 scores are head_dim broadcast-FMAs with no horizontal sums;
// - at most kDirectRows rows per kv head (decode: one token x the group): each key and value row is
//   converted in registers (each is read once per sub-block), the key rows are dotted with the few rows,
//   and each row's 16 partial-sum vectors are reduced at once (sum_lanes16). For so few rows the transpose
//   costs more shuffles than these reductions, and the conversion buffers' stores and reloads go too:
//   1.3-1.6x faster on a cold bf16 cache, 1.7-2x on int8 (benchmarks/README.md, kv_attention.py --cold).

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

// 16 elements of a cache row -> float32, before the row's simd_scale (kv_types.h).
template <typename CT>
inline __m512 load16(const uint8_t* p) {
  if constexpr (std::is_same_v<CT, float>) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (std::is_same_v<CT, bf16_t>) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  } else if constexpr (std::is_same_v<CT, int8_t>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else {
    const __m256 one = _mm256_set1_ps(1.f);
    return _mm512_insertf32x8(_mm512_castps256_ps512(load8<CT>(p, one)), load8<CT>(p + 8, one), 1);
  }
}

// Lane j of the result = the sum of v[j]'s 16 lanes: pairwise interleave-and-add, 30 shuffles in all.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // a[i], each 128-bit lane: rows 2i, 2i+1, 2i, 2i+1
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // b[i], each 128-bit lane: rows 4i .. 4i+3
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// Gemma 2's score cap, cap * tanh(s / cap), 16 scores at a time: tanh(x) = 1 - 2 / (e^2x + 1), with x clamped
// to +-9 (tanh is 1 in float32 from 9.01 on) so that e^2x stays finite. Absolute error ~1e-7 * cap, as the
// portable path's std::tanh; the relative error near 0 does not matter to a softmax.
inline __m512 softcap512(__m512 s, float cap) {
  const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(s, _mm512_set1_ps(2.f / cap)), _mm512_set1_ps(-18.f)),
                                 _mm512_set1_ps(18.f));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(exp512(x), one)));
  return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}

// Online-softmax update of one row with its sub-block scores s, of which keys lo .. limit-1 are the ones the row
// sees (causal: limit; a sliding window: lo), capped first when cap > 0: m and l move, p receives e^(s - m) (0
// outside [lo, limit)); returns the factor for the row's acc.
inline float softmax_update(__m512 s, int64_t lo, int64_t limit, float cap, float& m, float& l, float* p) {
  const auto below = [](int64_t n) {  // lanes 0 .. n-1
    return n <= 0 ? 0u : n >= 16 ? 0xFFFFu : (1u << n) - 1u;
  };
  const __mmask16 mask = static_cast<__mmask16>(below(limit) & ~below(lo));
  if (mask == 0) {  // every key of this sub-block is in this row's future (or left its window)
    _mm512_storeu_ps(p, _mm512_setzero_ps());
    return 1.f;
  }
  if (cap > 0.f) s = softcap512(s, cap);
  s = _mm512_mask_mov_ps(_mm512_set1_ps(kMinScore), mask, s);
  const float m_new = std::max(m, _mm512_reduce_max_ps(s));
  const __m512 e = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
  const float corr = m_new == m ? 1.f : std::exp(m - m_new);  // the max rarely moves after a few blocks
  l = l * corr + _mm512_reduce_add_ps(e);
  m = m_new;
  _mm512_storeu_ps(p, e);
  return corr;
}

// Dims per register pass of accumulate_pv: NR * S accumulators and S value vectors within the 32 zmm registers
// (S divides NV; head_dim 256 with 4 rows: 4 passes of 64 dims, each reading its quarter of the value rows).
template <int NR, int NV>
constexpr int pv_slice() {
  int s = NV;
  while ((NR + 1) * s > 30 || NV % s != 0) --s;
  return s;
}

// acc rows r0.. r0+NR-1 (in memory) = acc * corr + P x V over nk keys, in registers. v: the first key's
// value row, rows slot_bytes apart, of type CT with hd elements (8-bit rows: their scale folds into p).
// Each element's sum runs over the keys in order whatever the slicing.
template <int NR, int NV, typename CT>
inline void accumulate_pv(float* acc, const float* p, const float* corr, const uint8_t* v, int64_t slot_bytes,
                          int64_t nk, int64_t hd) {
  constexpr int S = pv_slice<NR, NV>();
  for (int i0 = 0; i0 < NV; i0 += S) {
    __m512 a[NR][S];
    for (int r = 0; r < NR; ++r) {
      const __m512 c = _mm512_set1_ps(corr[r]);
      for (int i = 0; i < S; ++i) a[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * 16 * NV + 16 * (i0 + i)), c);
    }
    for (int64_t j = 0; j < nk; ++j) {
      const uint8_t* row = v + j * slot_bytes;
      __m512 vv[S];
      for (int i = 0; i < S; ++i) vv[i] = load16<CT>(row + 16 * (i0 + i) * sizeof(CT));
      const float scale = simd_scale<CT>(row, hd);
      for (int r = 0; r < NR; ++r) {
        const __m512 pj = _mm512_set1_ps(is_8bit_v<CT> ? p[r * 16 + j] * scale : p[r * 16 + j]);
        for (int i = 0; i < S; ++i) a[r][i] = _mm512_fmadd_ps(pj, vv[i], a[r][i]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < S; ++i) _mm512_storeu_ps(acc + r * 16 * NV + 16 * (i0 + i), a[r][i]);
  }
}

// accumulate_pv with the row count known at run time (nr <= RC).
template <int RC, int NV, typename CT>
inline void accumulate_pv_n(int nr, float* acc, const float* p, const float* corr, const uint8_t* v,
                            int64_t slot_bytes, int64_t nk, int64_t hd) {
  switch (nr) {  // register-resident accumulators need the row count at compile time
    case 6:
      if constexpr (RC >= 6) { accumulate_pv<6, NV, CT>(acc, p, corr, v, slot_bytes, nk, hd); break; }
      [[fallthrough]];
    case 5:
      if constexpr (RC >= 5) { accumulate_pv<5, NV, CT>(acc, p, corr, v, slot_bytes, nk, hd); break; }
      [[fallthrough]];
    case 4:
      if constexpr (RC >= 4) { accumulate_pv<4, NV, CT>(acc, p, corr, v, slot_bytes, nk, hd); break; }
      [[fallthrough]];
    case 3: accumulate_pv<3, NV, CT>(acc, p, corr, v, slot_bytes, nk, hd); break;
    case 2: accumulate_pv<2, NV, CT>(acc, p, corr, v, slot_bytes, nk, hd); break;
    default: accumulate_pv<1, NV, CT>(acc, p, corr, v, slot_bytes, nk, hd); break;
  }
}

// Calls f(kp0, nk, slot0) for each sub-block of the tile's keys (kp0 .. kp0+nk-1, at most 16 and inside one
// block, whose first slot is slot0), prefetching ahead at each block's start.
template <bool Ahead = true, typename F>
inline void for_each_sub_block(const Tile& t, F&& f) {
  const int64_t last_pos = last_key(t), bs = t.block_size;
  for (int64_t kp0 = t.key_begin; kp0 <= last_pos;) {
    const int64_t nk = std::min<int64_t>({16, bs - kp0 % bs, last_pos + 1 - kp0});
    if (Ahead && kp0 % bs == 0) prefetch_ahead(t, kp0 / bs, last_pos);
    f(kp0, nk, t.table[kp0 / bs] * bs + kp0 % bs);
    kp0 += nk;
  }
}

// How many keys from position kp0 on a row sees (causal): capped by the caller at the sub-block's nk.
inline int64_t causal_limit(const Tile& t, int64_t row, int64_t kp0) {
  return t.pos0 + (row / t.group) % t.n_q + 1 - kp0;
}

// How many keys from position kp0 on are before the row's window (0 without one): the sub-block's first visible
// key for that row.
inline int64_t window_start(const Tile& t, int64_t row, int64_t kp0) {
  return t.window > 0 ? t.pos0 + (row / t.group) % t.n_q - t.window + 1 - kp0 : 0;
}

// The first 64-byte aligned float at or after p (its buffer has 16 floats to spare): aligned loads of kt, and
// accumulator rows that do not straddle cache lines.
inline float* align64(float* p) { return p + (16 - (reinterpret_cast<uintptr_t>(p) / sizeof(float)) % 16) % 16; }

template <int NV>
constexpr int kRowChunk = NV <= 4 ? 6 : 3;  // rows per register chunk (accumulate_pv slices the dims)

// The floats attend_rows_transposed needs in `buf`.
template <int NV, typename CT>
int64_t transposed_buffer(const Tile& t) {
  return 16 * 16 * NV + 16 + kRowChunk<NV> * 17 + (std::is_same_v<CT, float> ? 0 : 2 * 16 * t.kv_heads * 16 * NV);
}

// Many rows per head: transposed key slabs from the converted sub-block (see the top of this file).
template <int NV, typename CT>
void attend_rows_transposed(const Tile& t, const float* q, float* acc, float* m, float* l, float* buf) {
  constexpr int D = 16 * NV, RC = kRowChunk<NV>;
  const int64_t rph = rows_per_head(t);
  float* kt = align64(buf);  // [D][16] transposed keys of the current sub-block and head
  float* p = kt + D * 16;     // [RC][16] probabilities of the current row chunk
  float* corr = p + RC * 16;  // [RC]
  // [16][kv_heads][D] converted keys and values of the sub-block: each value row serves every row chunk
  float* k_buf = corr + RC;
  float* v_buf = k_buf + (std::is_same_v<CT, float> ? 0 : 16 * t.kv_heads * D);
  __m512 slab[16], cols[16];
  for_each_sub_block(t, [&](int64_t kp0, int64_t nk, int64_t slot0) {
    int64_t ks, vs;
    const float* kb = kv_rows<CT>(t, t.k_cache, slot0, nk, k_buf, ks);
    const float* vb = kv_rows<CT>(t, t.v_cache, slot0, nk, v_buf, vs);
    for (int64_t h = 0; h < t.kv_heads; ++h) {
      const float* kh = kb + h * D;
      for (int v = 0; v < NV; ++v) {
        for (int j = 0; j < 16; ++j)
          slab[j] = j < nk ? _mm512_loadu_ps(kh + j * ks + 16 * v) : _mm512_setzero_ps();
        transpose16(slab, cols);
        for (int c = 0; c < 16; ++c) _mm512_store_ps(kt + (16 * v + c) * 16, cols[c]);
      }
      const uint8_t* vh = reinterpret_cast<const uint8_t*>(vb + h * D);
      for (int64_t r0 = h * rph; r0 < (h + 1) * rph; r0 += RC) {
        const int nr = static_cast<int>(std::min<int64_t>(RC, (h + 1) * rph - r0));
        for (int r = 0; r < nr; ++r) {
          const float* qr = q + (r0 + r) * D;
          __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
          for (int d = 0; d < D; d += 2) {
            s0 = _mm512_fmadd_ps(_mm512_set1_ps(qr[d]), _mm512_load_ps(kt + d * 16), s0);
            s1 = _mm512_fmadd_ps(_mm512_set1_ps(qr[d + 1]), _mm512_load_ps(kt + (d + 1) * 16), s1);
          }
          corr[r] = softmax_update(_mm512_add_ps(s0, s1), window_start(t, r0 + r, kp0),
                                   std::min(nk, causal_limit(t, r0 + r, kp0)), t.softcap, m[r0 + r], l[r0 + r],
                                   p + r * 16);
        }
        accumulate_pv_n<RC, NV, float>(nr, acc + r0 * D, p, corr, vh, vs * sizeof(float), nk, D);
      }
    }
  });
}

// At most kDirectRows rows per head (decode: one token x a GQA group of up to 8): dot products straight from the
// cache rows, in passes of at most kDirectChunk rows over each sub-block (NR * 16 partial sums and NR * S
// accumulators per pass; the passes after a head's first read its key and value rows from L1). A row's
// arithmetic is the same whichever pass holds it.
constexpr int64_t kDirectRows = 8, kDirectChunk = 4;

// Tile rows r0 .. r0+NR-1, all of one kv head, against the nk keys of one sub-block: kh and vh are the head's
// first key and value rows. The first ahead_n key rows' counterparts kPrefetchBlocks blocks on (ahead_at, the
// same head) are requested as the key rows are read.
template <int NR, int NV, typename CT>
void direct_pass(const Tile& t, const float* q, float* acc, float* m, float* l, int64_t r0, int64_t kp0, int64_t nk,
                 const uint8_t* kh, const uint8_t* vh, int64_t ahead_n, int64_t ahead_at) {
  constexpr int D = 16 * NV;
  alignas(64) float p[NR * 16];
  float corr[NR];
  alignas(64) float scales[16] = {};  // 8-bit rows' scales; lanes past nk keep finite values
  __m512 part[NR][16];  // part[r][j]: q_r * k_j lane by lane, summed over the row's NV vectors
  const float* qr0 = q + r0 * D;
  for (int j = 0; j < 16; ++j) {
    if (j >= nk) {
      for (int r = 0; r < NR; ++r) part[r][j] = _mm512_setzero_ps();
      continue;
    }
    const uint8_t* row = kh + j * t.slot_bytes;
    if (j < ahead_n) prefetch_rows(t, ahead_at + j * t.slot_bytes);
    __m512 kv[NV];
    for (int i = 0; i < NV; ++i) kv[i] = load16<CT>(row + 16 * i * sizeof(CT));
    if constexpr (is_8bit_v<CT>) scales[j] = simd_scale<CT>(row, D);
    for (int r = 0; r < NR; ++r) {
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qr0 + r * D), kv[0]);
      for (int i = 1; i < NV; ++i) x = _mm512_fmadd_ps(_mm512_loadu_ps(qr0 + r * D + 16 * i), kv[i], x);
      part[r][j] = x;
    }
  }
  for (int r = 0; r < NR; ++r) {
    __m512 s = sum_lanes16(part[r]);
    if constexpr (is_8bit_v<CT>) s = _mm512_mul_ps(s, _mm512_load_ps(scales));  // lanes past nk: masked
    const int64_t row = r0 + r;
    corr[r] = softmax_update(s, window_start(t, row, kp0), std::min(nk, causal_limit(t, row, kp0)), t.softcap,
                             m[row], l[row], p + r * 16);
  }
  accumulate_pv<NR, NV, CT>(acc + r0 * D, p, corr, vh, t.slot_bytes, nk, D);
}

template <int NV, typename CT>
void attend_rows_direct(const Tile& t, const float* q, float* acc, float* m, float* l) {
  const int64_t last_pos = last_key(t), bs = t.block_size, rph = rows_per_head(t);
  for_each_sub_block<false>(t, [&](int64_t kp0, int64_t nk, int64_t slot0) {
    if (kp0 == t.key_begin)
      for (int64_t i = 1; i < kPrefetchBlocks; ++i) prefetch_block(t, kp0 / bs + i, last_pos);
    // The same slots kPrefetchBlocks blocks ahead, requested row by row as this sub-block's rows are read
    // (see prefetch_rows).
    const int64_t ahead = kp0 / bs + kPrefetchBlocks;
    const int64_t ahead_n = std::min(nk, last_pos + 1 - (ahead * bs + kp0 % bs));
    const int64_t ahead_at = ahead_n > 0 ? (t.table[ahead] * bs + kp0 % bs) * t.slot_bytes : 0;
    for (int64_t h = 0; h < t.kv_heads; ++h) {
      const uint8_t* kh = t.k_cache + slot0 * t.slot_bytes + h * t.row_bytes;
      const uint8_t* vh = t.v_cache + slot0 * t.slot_bytes + h * t.row_bytes;
      const int64_t at = ahead_at + h * t.row_bytes;
      for (int64_t r0 = h * rph; r0 < (h + 1) * rph; r0 += kDirectChunk) {
        const int64_t n_ahead = r0 == h * rph ? ahead_n : 0;
        switch (std::min(kDirectChunk, (h + 1) * rph - r0)) {  // register-resident rows: a compile-time count
          case 4: direct_pass<4, NV, CT>(t, q, acc, m, l, r0, kp0, nk, kh, vh, n_ahead, at); break;
          case 3: direct_pass<3, NV, CT>(t, q, acc, m, l, r0, kp0, nk, kh, vh, n_ahead, at); break;
          case 2: direct_pass<2, NV, CT>(t, q, acc, m, l, r0, kp0, nk, kh, vh, n_ahead, at); break;
          default: direct_pass<1, NV, CT>(t, q, acc, m, l, r0, kp0, nk, kh, vh, n_ahead, at); break;
        }
      }
    }
  });
}

template <int NV, typename CT>
void attend_rows_avx512(const Tile& t, const float* q, float* o, float* lse, std::vector<float>& scratch) {
  constexpr int D = 16 * NV;
  const int64_t rph = rows_per_head(t), rows = rph * t.kv_heads;
  // batch-invariant tiles: the direct path at every size (attention_tile.h)
  const bool direct = rph <= kDirectRows || t.invariant;
  scratch.assign(16 + rows * (D + 2) + (direct ? 0 : transposed_buffer<NV, CT>(t)), 0.f);
  float* acc = align64(scratch.data());
  float* m = acc + rows * D;
  float* l = m + rows;
  std::fill(m, m + rows, kMinScore);
  if (direct) {
    attend_rows_direct<NV, CT>(t, q, acc, m, l);
  } else {
    attend_rows_transposed<NV, CT>(t, q, acc, m, l, l + rows);
  }
  normalize_rows(acc, m, l, rows, D, o, lse);
}
