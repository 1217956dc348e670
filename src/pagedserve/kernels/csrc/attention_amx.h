// AMX tile for prefill: bf16 queries on a bf16 or 8-bit cache, head_dim a multiple of 32, more than
// kDirectRows rows per kv head. Included by attention_tile.h, inside namespace pagedserve, only in the `amx`
// variant (PAGEDSERVE_AMX, amx_state.h); decode rows and every other case keep the AVX-512 paths.
#pragma once

// Q K^T and P V run as TDPBF16PS (bf16 products, float32 sums); the online softmax stays float32 in AVX-512
// (softmax_update). A tile's rows of one kv head go 16 at a time (a row group, zero rows past the end):
//
//   per sub-block of <= 16 keys (for_each_sub_block), per kv head:
//     kt = K^T in B-tile layout (pairs of dims x 16 keys), one transpose16 per 32 dims   (shared by groups)
//     vv = V in B-tile layout (pairs of keys x 16 dims), for each 16 dims               (shared by groups)
//     per row group:  S = Q kt (float32) -> softmax_update per row -> P (bf16, 16 x 16 keys)
//                     acc = acc * corr; acc += P vv   (acc tiles loaded from and stored to float32 rows)
//
// Queries enter unscaled and unrounded (they are bf16 already): the scale multiplies S in float32. The only
// rounding beyond the float32 paths' is P's, to bf16 (relative 2^-9 per weight). An 8-bit cache feeds its codes
// (exact in bf16: int8 to +-127, e4m3 through load16) and its row scales multiply S's columns and P's weights.

// Tiles 0-3: C, 16 rows x 16 float32 (S, or acc for 16 dims each); 4: A, 16 query rows x 32 dims;
// 5: B, kt for 32 dims; 6: A, P (16 rows x 16 keys); 7: B, vv for 16 dims (8 key pairs).
struct alignas(64) AttentionTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  AttentionTileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
    colsb[6] = 32;
    rows[7] = 8;
  }
};

inline bool amx_applies(const Tile& t) { return t.head_dim % 32 == 0 && rows_per_head(t) > kDirectRows; }

// 32 elements of a cache row (dims d .. d+31) as bf16 codes: the stored bits for bf16, exact conversions
// for 8-bit rows (their simd_scale is applied by the caller).
template <typename CT>
inline __m512i load32_bf16(const uint8_t* row, int64_t d) {
  if constexpr (std::is_same_v<CT, bf16_t>) {
    return _mm512_loadu_si512(row + 2 * d);
  } else {
    const __m512 lo = load16<CT>(row + d), hi = load16<CT>(row + d + 16);
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// The sub-block's keys of kv head h (nk of them, from slot0) as B tiles, [D/32][16 dim pairs][16 keys] u32,
// zero columns past nk; scales[j] = key j's simd_scale (8-bit caches).
template <typename CT>
inline void keys_to_tiles(const Tile& t, int64_t h, int64_t slot0, int64_t nk, uint32_t* kt, float* scales) {
  const uint8_t* base = t.k_cache + slot0 * t.slot_bytes + h * t.row_bytes;
  __m512 rows[16], cols[16];
  for (int64_t c = 0; c < t.head_dim / 32; ++c) {
    for (int j = 0; j < 16; ++j)
      rows[j] = j < nk ? _mm512_castsi512_ps(load32_bf16<CT>(base + j * t.slot_bytes, 32 * c)) : _mm512_setzero_ps();
    transpose16(rows, cols);
    for (int k = 0; k < 16; ++k) _mm512_store_ps(reinterpret_cast<float*>(kt + (c * 16 + k) * 16), cols[k]);
  }
  if constexpr (is_8bit_v<CT>)
    for (int j = 0; j < 16; ++j) scales[j] = j < nk ? simd_scale<CT>(base + j * t.slot_bytes, t.head_dim) : 0.f;
}

// The sub-block's values of kv head h as B tiles, [D/16][8 key pairs][16 dims x 2] bf16: row p of tile i
// interleaves dims 16i .. 16i+15 of keys 2p and 2p+1; zero past nk. scales as in keys_to_tiles.
template <typename CT>
inline void values_to_tiles(const Tile& t, int64_t h, int64_t slot0, int64_t nk, uint16_t* vv, float* scales) {
  const uint8_t* base = t.v_cache + slot0 * t.slot_bytes + h * t.row_bytes;
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t p = 0; p < 8; ++p)
    for (int64_t c = 0; c < t.head_dim / 32; ++c) {
      const __m512i a = 2 * p < nk ? load32_bf16<CT>(base + 2 * p * t.slot_bytes, 32 * c) : _mm512_setzero_si512();
      const __m512i b =
          2 * p + 1 < nk ? load32_bf16<CT>(base + (2 * p + 1) * t.slot_bytes, 32 * c) : _mm512_setzero_si512();
      _mm512_store_si512(vv + ((2 * c) * 8 + p) * 32, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(vv + ((2 * c + 1) * 8 + p) * 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  if constexpr (is_8bit_v<CT>)
    for (int j = 0; j < 16; ++j) scales[j] = j < nk ? simd_scale<CT>(base + j * t.slot_bytes, t.head_dim) : 0.f;
}

// Buffers of attend_tile_amx, carved from TileScratch::work (float32 slots, 64-byte aligned pieces).
struct AmxBuffers {
  uint16_t* q;    // [kv_heads][groups * 16][D] bf16 queries, zero rows past each head's rows
  float* acc;     // [kv_heads][groups * 16][D]
  float* m;       // [kv_heads][groups * 16]
  float* l;
  uint32_t* kt;   // [D/32][16][16]
  uint16_t* vv;   // [D/16][8][32]
  float* s;       // [16][16] scores of one row group
  uint16_t* p;    // [16][16] bf16 weights of one row group
  float* pf;      // [16][16] float32 weights from softmax_update
  float* kscale;  // [16]
  float* vscale;  // [16]
};

inline AmxBuffers amx_buffers(const Tile& t, std::vector<float>& work) {
  const int64_t D = t.head_dim, padded = (rows_per_head(t) + 15) / 16 * 16 * t.kv_heads;
  const int64_t sizes[] = {padded * D / 2, padded * D, padded, padded, D * 8, D * 8, 256, 128, 256, 16, 16};
  int64_t total = 16;
  for (const int64_t n : sizes) total += (n + 15) / 16 * 16;
  work.resize(total);
  float* at = align64(work.data());
  float* parts[11];
  for (int i = 0; i < 11; ++i) parts[i] = at, at += (sizes[i] + 15) / 16 * 16;
  return {reinterpret_cast<uint16_t*>(parts[0]), parts[1], parts[2], parts[3], reinterpret_cast<uint32_t*>(parts[4]),
          reinterpret_cast<uint16_t*>(parts[5]), parts[6], reinterpret_cast<uint16_t*>(parts[7]), parts[8],
          parts[9], parts[10]};
}

// The tile's bf16 queries, rows ordered as attention_tile.h's, each head's rows padded to whole groups.
inline void load_queries_bf16(const Tile& t, uint16_t* q, int64_t padded_rph) {
  const bf16_t* base = static_cast<const bf16_t*>(t.q);
  std::fill(q, q + t.kv_heads * padded_rph * t.head_dim, bf16_t{0});
  for (int64_t h = 0; h < t.kv_heads; ++h)
    for (int64_t i = 0; i < t.n_q; ++i)
      for (int64_t g = 0; g < t.group; ++g)
        std::memcpy(q + (h * padded_rph + i * t.group + g) * t.head_dim,
                    base + i * t.q_tok_stride + (h * t.group + g) * t.q_head_stride, t.head_dim * sizeof(bf16_t));
}

// One row group (rows r0 .. r0+nr-1 of the tile, 16-row block `qrow` of the padded queries) against the
// sub-block in kt / vv.
template <typename CT>
inline void attend_group_amx(const Tile& t, const AmxBuffers& b, int64_t r0, int64_t nr, int64_t qrow, int64_t kp0,
                             int64_t nk) {
  const int64_t D = t.head_dim;
  _tile_zero(0);
  for (int64_t c = 0; c < D / 32; ++c) {
    _tile_loadd(4, b.q + qrow * D + 32 * c, D * 2);
    _tile_loadd(5, b.kt + c * 256, 64);
    _tile_dpbf16ps(0, 4, 5);
  }
  _tile_stored(0, b.s, 64);
  const __m512 kscale = is_8bit_v<CT> ? _mm512_mul_ps(_mm512_load_ps(b.kscale), _mm512_set1_ps(t.scale))
                                      : _mm512_set1_ps(t.scale);
  alignas(64) float corr[16];
  bool rescale = false;
  for (int64_t r = 0; r < 16; ++r) {
    if (r >= nr) {  // padding rows: zero weights
      _mm256_store_si256(reinterpret_cast<__m256i*>(b.p + r * 16), _mm256_setzero_si256());
      corr[r] = 1.f;
      continue;
    }
    const __m512 s = _mm512_mul_ps(_mm512_load_ps(b.s + r * 16), kscale);
    corr[r] = softmax_update(s, std::min(nk, causal_limit(t, r0 + r, kp0)), b.m[qrow + r], b.l[qrow + r],
                             b.pf + r * 16);
    __m512 w = _mm512_load_ps(b.pf + r * 16);
    if constexpr (is_8bit_v<CT>) w = _mm512_mul_ps(w, _mm512_load_ps(b.vscale));
    _mm256_store_si256(reinterpret_cast<__m256i*>(b.p + r * 16), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(w)));
    rescale |= corr[r] != 1.f;
  }
  float* acc = b.acc + qrow * D;
  if (rescale)
    for (int64_t r = 0; r < nr; ++r) {
      const __m512 c = _mm512_set1_ps(corr[r]);
      for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(acc + r * D + d, _mm512_mul_ps(_mm512_load_ps(acc + r * D + d), c));
    }
  _tile_loadd(6, b.p, 32);
  for (int64_t i = 0; i < D / 16; ++i) {
    _tile_loadd(0, acc + 16 * i, D * 4);
    _tile_loadd(7, b.vv + i * 256, 64);
    _tile_dpbf16ps(0, 6, 7);
    _tile_stored(0, acc + 16 * i, D * 4);
  }
}

// attend_tile for the AMX case: writes the tile's float32 outputs to o (rows x head_dim).
template <typename CT>
void attend_tile_amx(const Tile& t, float* o, std::vector<float>& work) {
  const int64_t D = t.head_dim, rph = rows_per_head(t), padded_rph = (rph + 15) / 16 * 16;
  const AmxBuffers b = amx_buffers(t, work);
  load_queries_bf16(t, b.q, padded_rph);
  std::fill(b.acc, b.acc + t.kv_heads * padded_rph * D, 0.f);
  std::fill(b.m, b.m + t.kv_heads * padded_rph, kMinScore);
  std::fill(b.l, b.l + t.kv_heads * padded_rph, 0.f);
  const AttentionTileConfig cfg;
  _tile_loadconfig(&cfg);
  for_each_sub_block(t, [&](int64_t kp0, int64_t nk, int64_t slot0) {
    for (int64_t h = 0; h < t.kv_heads; ++h) {
      keys_to_tiles<CT>(t, h, slot0, nk, b.kt, b.kscale);
      values_to_tiles<CT>(t, h, slot0, nk, b.vv, b.vscale);
      for (int64_t g = 0; g < rph; g += 16)
        attend_group_amx<CT>(t, b, h * rph + g, std::min<int64_t>(16, rph - g), h * padded_rph + g, kp0, nk);
    }
  });
  _tile_release();
  for (int64_t h = 0; h < t.kv_heads; ++h)
    normalize_rows(b.acc + h * padded_rph * D, b.l + h * padded_rph, rph, D, o + h * rph * D);
}
