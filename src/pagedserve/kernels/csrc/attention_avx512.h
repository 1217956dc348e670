// AVX-512 tile for head_dim = 16 * NV. Included by attention_tile.h, inside namespace pagedserve, only
// when the compiler targets AVX-512 (the avx512 variant; pagedserve/kernels/isa.py). A cache of another
// type than float32 is converted 16 keys at a time (kv_rows) into a buffer the sub-block then reads.
#pragma once

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

// One kv head's rows against one sub-block (nk <= 16 keys): scores from the transposed keys kt, online
// softmax update of (m, l), then acc += P x V, RC rows at a time with the accumulators in registers.
template <int NV, int RC>
inline void attend_sub_block(const Tile& t, int64_t row0, int64_t row_end, int64_t kp0, int64_t nk,
                             const float* kt, const float* vh, int64_t v_stride, const float* q, float* acc,
                             float* m, float* l, float* p, float* corr) {
  constexpr int D = 16 * NV;
  for (int64_t r0 = row0; r0 < row_end; r0 += RC) {
    const int nr = static_cast<int>(std::min<int64_t>(RC, row_end - r0));
    for (int r = 0; r < nr; ++r) {
      const int64_t row = r0 + r;
      const int64_t limit = std::min(nk, t.pos0 + (row / t.group) % t.n_q + 1 - kp0);  // causal
      const float* qr = q + row * D;
      __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 2) {
        s0 = _mm512_fmadd_ps(_mm512_set1_ps(qr[d]), _mm512_load_ps(kt + d * 16), s0);
        s1 = _mm512_fmadd_ps(_mm512_set1_ps(qr[d + 1]), _mm512_load_ps(kt + (d + 1) * 16), s1);
      }
      const __mmask16 mask = limit <= 0 ? 0 : static_cast<__mmask16>((1u << limit) - 1u);
      if (mask == 0) {  // every key of this sub-block is in this row's future
        corr[r] = 1.f;
        _mm512_storeu_ps(p + r * 16, _mm512_setzero_ps());
        continue;
      }
      const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(kMinScore), mask, _mm512_add_ps(s0, s1));
      const float m_new = std::max(m[row], _mm512_reduce_max_ps(s));
      const __m512 e = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
      corr[r] = m_new == m[row] ? 1.f : std::exp(m[row] - m_new);  // the max rarely moves after a few blocks
      l[row] = l[row] * corr[r] + _mm512_reduce_add_ps(e);
      m[row] = m_new;
      _mm512_storeu_ps(p + r * 16, e);
    }
    float* a = acc + r0 * D;
    switch (nr) {  // register-resident accumulators need the row count at compile time
      case 6: if constexpr (RC >= 6) { accumulate_pv<6, NV>(a, p, corr, vh, v_stride, nk); break; } [[fallthrough]];
      case 5: if constexpr (RC >= 5) { accumulate_pv<5, NV>(a, p, corr, vh, v_stride, nk); break; } [[fallthrough]];
      case 4: if constexpr (RC >= 4) { accumulate_pv<4, NV>(a, p, corr, vh, v_stride, nk); break; } [[fallthrough]];
      case 3: accumulate_pv<3, NV>(a, p, corr, vh, v_stride, nk); break;
      case 2: accumulate_pv<2, NV>(a, p, corr, vh, v_stride, nk); break;
      default: accumulate_pv<1, NV>(a, p, corr, vh, v_stride, nk); break;
    }
  }
}

// The next sub-block's K/V rows (all heads of the tile: `width` bytes a slot) into L2. Blocks are scattered,
// so the hardware prefetcher cannot follow them; measured, L2 beats L1 here (too many L1 prefetches in
// flight get dropped).
inline void prefetch_sub_block(const Tile& t, int64_t kp, int64_t last_pos, int64_t width) {
  if (kp > last_pos) return;
  const int64_t bs = t.block_size;
  const int64_t slot = t.table[kp / bs] * bs + kp % bs;
  const int64_t n = std::min<int64_t>({16, bs - kp % bs, last_pos + 1 - kp});
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < width; c += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(t.k_cache + (slot + j) * t.slot_bytes + c), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(t.v_cache + (slot + j) * t.slot_bytes + c), _MM_HINT_T1);
    }
}

template <int NV, typename CT>
void attend_rows_avx512(const Tile& t, const float* q, float* o, std::vector<float>& scratch) {
  constexpr int D = 16 * NV;
  constexpr int RC = NV <= 4 ? 6 : 3;  // rows per register chunk: RC * NV accumulators + NV values
  const int64_t rph = rows_per_head(t), rows = rph * t.kv_heads;
  const int64_t kv_buf = std::is_same_v<CT, float> ? 0 : 16 * t.kv_heads * D;
  scratch.assign(D * 16 + 16 + rows * D + rows * 2 + RC * 16 + RC + 2 * kv_buf, 0.f);
  // kt: [D][16] transposed keys of the current sub-block and head, 64-byte aligned for aligned loads.
  float* kt = scratch.data() + (16 - (reinterpret_cast<uintptr_t>(scratch.data()) / sizeof(float)) % 16) % 16;
  float* acc = kt + D * 16;
  float* m = acc + rows * D;
  float* l = m + rows;
  float* p = l + rows;        // [RC][16] probabilities of the current row chunk
  float* corr = p + RC * 16;  // [RC]
  float* k_buf = corr + RC;   // [16][kv_heads][D] converted keys (and values) of the sub-block
  float* v_buf = k_buf + kv_buf;
  std::fill(m, m + rows, kMinScore);
  const int64_t last_pos = t.pos0 + t.n_q - 1, bs = t.block_size;
  __m512 slab[16], cols[16];
  for (int64_t kp0 = 0; kp0 <= last_pos;) {
    // Sub-block: keys kp0 .. kp0+nk-1, at most 16 and all inside one block.
    const int64_t nk = std::min<int64_t>({16, bs - kp0 % bs, last_pos + 1 - kp0});
    const int64_t slot0 = t.table[kp0 / bs] * bs + kp0 % bs;
    prefetch_sub_block(t, kp0 + nk, last_pos, t.kv_heads * t.row_bytes);
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
      attend_sub_block<NV, RC>(t, h * rph, (h + 1) * rph, kp0, nk, kt, vb + h * D, vs, q, acc, m, l, p, corr);
    }
    kp0 += nk;
  }
  normalize_rows(acc, l, rows, D, o);
}
