// AMX tile for prefill: bf16 queries on a bf16 or 8-bit cache, head_dim a multiple of 32, more than
// kDirectChunk (4) rows per kv head. Included by attention_tile.h, inside namespace pagedserve, only in the `amx`
// variant (PAGEDSERVE_AMX, amx_state.h); decode rows and every other case keep the AVX-512 paths.
#pragma once

// Q K^T and P V run as TDPBF16PS (bf16 products, float32 sums); the online softmax stays float32 in AVX-512.
// A tile's rows of one kv head go 16 at a time (a row group; zero rows past the end); keys go in chunks of two
// sub-blocks (up to 32 keys, each sub-block inside one block). Scores come out transposed, S^T = K Q^T (16 keys x
// 16 rows per sub-block), so that the keys are the A tile, loaded straight from a bf16 cache's rows, and the
// softmax is vertical: one vector per key holds its scores for the 16 rows, the rows' maxima, sums and rescale
// factors are elementwise max / add / exp over those vectors, with no horizontal reductions. Then 2^(S - m) is
// turned into P (16 rows x 32 keys, bf16: a full A tile) for acc += P V:
//
//   per row group, once per tile:  qt = Q^T in B-tile layout (pairs of dims x 16 rows), per 32 dims
//   per chunk of <= 32 keys, per kv head:
//     vv = V in B-tile layout (16 pairs of keys x 16 dims), per 16 dims                  (shared by groups)
//     per row group:  S^T = K qt                                           (phase 1: every group's scores)
//     per row group:  m' = max(m, max_j s_j); e_j = 2^(s_j - m'); l = l 2^(m - m') + sum_j e_j;
//                     acc = acc 2^(m - m') (only when a row's max moved); P = e^T in bf16        (phase 2)
//     per row group:  acc += P vv                                                              (phase 3)
//
// The phases keep each tile load away from the stores that feed it (S's, P's): one group at a time, every load
// waited on the store just before it (1.2-1.45x slower). Scores are in base-2 units (the scale times log2 e
// multiplies S in float32), so each weight is one exp2_512.
//
// Queries enter unscaled and unrounded (they are bf16 already). The only rounding beyond the float32 paths' is
// P's, to bf16 (relative 2^-9 per weight). An 8-bit cache feeds its codes (exact in bf16: int8 to +-127, e4m3
// through load16); its row scales multiply S's rows and P's columns.

// The query and cache types the AMX tiles take (float32 caches keep float32 arithmetic).
template <typename QT, typename CT>
constexpr bool amx_types_v = std::is_same_v<QT, bf16_t> && !std::is_same_v<CT, float>;

// From 5 rows per kv head, as measured on AMX before the AVX-512 direct path took up to 8 (GQA-8 decode).
inline bool amx_applies(const Tile& t) { return t.head_dim % 32 == 0 && rows_per_head(t) > kDirectChunk; }

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

// Scores are kept in base-2 units (times log2 e, folded into kscale), so that each weight is 2^(s - m):
// n = round(x), 2^(x - n) by a degree-5 polynomial (relative error 8e-8, below float32's rounding of the
// products), scaled by 2^n. x <= 0 always; x = kMinScore - m gives 0.
constexpr float kLog2e = 1.44269504088896341f;

inline __m512 exp2_512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3266970386e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6754597455e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507426160e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022121754e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314694916e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000000710f));
  return _mm512_scalef_ps(p, n);
}

// Buffers of attend_tile_amx, carved from TileScratch::work (float32 slots, 64-byte aligned pieces).
struct AmxBuffers {
  uint32_t* qt;   // [kv_heads][groups][D/32][16 dim pairs][16 rows] bf16 pairs
  float* acc;     // [kv_heads][groups * 16][D]
  float* m;       // [kv_heads][groups * 16]
  float* l;
  int32_t* pos;   // [kv_heads][groups * 16] each row's position; -1 for padding rows (sees no key)
  uint16_t* k;    // [2][16][D] bf16 keys of the chunk's two sub-blocks when they cannot be read in place
  uint16_t* vv;   // [D/16][16 key pairs][32]
  float* s;       // [groups][32 keys][16 rows] scores of one kv head's row groups
  uint16_t* p;    // [groups][16 rows][32 keys] bf16 weights
  float* kscale;  // [32] the keys' simd_scale (8-bit caches), times the attention scale
  float* vscale;  // [32] the values' simd_scale (8-bit caches); 0 for keys past the chunk's end
};

inline AmxBuffers amx_buffers(const Tile& t, std::vector<float>& work) {
  const int64_t D = t.head_dim, padded = (rows_per_head(t) + 15) / 16 * 16 * t.kv_heads;
  const int64_t sizes[] = {padded * D / 2, padded * D, padded, padded, padded, 16 * D, 16 * D, 32 * padded / t.kv_heads,
                           16 * padded / t.kv_heads, 32, 32};
  constexpr int kParts = sizeof(sizes) / sizeof(sizes[0]);
  int64_t total = 16;
  for (const int64_t n : sizes) total += (n + 15) / 16 * 16;
  work.resize(total);
  float* at = align64(work.data());
  float* parts[kParts];
  for (int i = 0; i < kParts; ++i) parts[i] = at, at += (sizes[i] + 15) / 16 * 16;
  return {reinterpret_cast<uint32_t*>(parts[0]), parts[1], parts[2], parts[3], reinterpret_cast<int32_t*>(parts[4]),
          reinterpret_cast<uint16_t*>(parts[5]), reinterpret_cast<uint16_t*>(parts[6]), parts[7],
          reinterpret_cast<uint16_t*>(parts[8]), parts[9], parts[10]};
}

// qt, pos, acc, m, l for the tile's rows (ordered as attention_tile.h's, each head padded to whole groups).
inline void prepare_rows(const Tile& t, const AmxBuffers& b, int64_t padded_rph) {
  const bf16_t* base = static_cast<const bf16_t*>(t.q);
  const int64_t D = t.head_dim, rph = rows_per_head(t), n = t.kv_heads * padded_rph;
  std::fill(b.acc, b.acc + n * D, 0.f);
  std::fill(b.m, b.m + n, kMinScore);
  std::fill(b.l, b.l + n, 0.f);
  __m512 rows[16], cols[16];
  for (int64_t h = 0; h < t.kv_heads; ++h)
    for (int64_t g = 0; g < padded_rph; g += 16)
      for (int64_t c = 0; c < D / 32; ++c) {
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t x = g + r, i = x / t.group;  // row x of the head: token i, head x % group of the group
          b.pos[h * padded_rph + x] = x < rph ? static_cast<int32_t>(t.pos0 + i) : -1;
          const bf16_t* q = base + i * t.q_tok_stride + (h * t.group + x % t.group) * t.q_head_stride + 32 * c;
          rows[r] = x < rph ? _mm512_loadu_ps(q) : _mm512_setzero_ps();
        }
        transpose16(rows, cols);
        uint32_t* dst = b.qt + ((h * padded_rph + g) / 16 * (D / 32) + c) * 256;
        for (int k = 0; k < 16; ++k) _mm512_store_ps(reinterpret_cast<float*>(dst + 16 * k), cols[k]);
      }
}

// One sub-block of a chunk: keys kp0 .. kp0+nk-1 (nk <= 16, inside one block, the first at slot0); nk = 0 for the
// missing second half of a chunk.
struct SubBlock {
  int64_t kp0 = 0, nk = 0, slot0 = 0;
};

// Where sub-block `half` (0 or 1) of the chunk's keys of kv head h are, as bf16 rows, and their stride in bytes: in
// place for a whole sub-block of a bf16 cache; otherwise converted into b.k's half, zero rows past nk. Sets the
// half's kscale (scale x each key's simd_scale) and vscale (0 past nk).
template <typename CT>
inline const uint16_t* key_rows(const Tile& t, const AmxBuffers& b, int64_t h, const SubBlock& sb, int half,
                                int64_t& stride) {
  const uint8_t* base = t.k_cache + sb.slot0 * t.slot_bytes + h * t.row_bytes;
  const uint8_t* vbase = t.v_cache + sb.slot0 * t.slot_bytes + h * t.row_bytes;
  for (int j = 0; j < 16; ++j) {
    const bool in = j < sb.nk;
    b.kscale[16 * half + j] =
        t.scale * kLog2e * (in && is_8bit_v<CT> ? simd_scale<CT>(base + j * t.slot_bytes, t.head_dim) : 1.f);
    b.vscale[16 * half + j] = in ? (is_8bit_v<CT> ? simd_scale<CT>(vbase + j * t.slot_bytes, t.head_dim) : 1.f) : 0.f;
  }
  if (std::is_same_v<CT, bf16_t> && sb.nk == 16) {
    stride = t.slot_bytes;
    return reinterpret_cast<const uint16_t*>(base);
  }
  uint16_t* k = b.k + half * 16 * t.head_dim;
  stride = t.head_dim * 2;
  for (int64_t j = 0; j < 16; ++j)
    for (int64_t d = 0; d < t.head_dim; d += 32)
      _mm512_store_si512(k + j * t.head_dim + d,
                         j < sb.nk ? load32_bf16<CT>(base + j * t.slot_bytes, d) : _mm512_setzero_si512());
  return k;
}

// A sub-block's values of kv head h into key pairs 8 * half .. 8 * half + 7 of the B tiles vv, [D/16][16 key
// pairs][16 dims x 2] bf16: row p of tile i interleaves dims 16i .. 16i+15 of the chunk's keys 2p and 2p+1; zero
// past nk (so P's zero weights never meet garbage).
template <typename CT>
inline void values_to_tiles(const Tile& t, int64_t h, const SubBlock& sb, int half, uint16_t* vv) {
  const uint8_t* base = t.v_cache + sb.slot0 * t.slot_bytes + h * t.row_bytes;
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int64_t nk = sb.nk;
  for (int64_t p = 0; p < 8; ++p)
    for (int64_t c = 0; c < t.head_dim / 32; ++c) {
      const __m512i a = 2 * p < nk ? load32_bf16<CT>(base + 2 * p * t.slot_bytes, 32 * c) : _mm512_setzero_si512();
      const __m512i b =
          2 * p + 1 < nk ? load32_bf16<CT>(base + (2 * p + 1) * t.slot_bytes, 32 * c) : _mm512_setzero_si512();
      _mm512_store_si512(vv + ((2 * c) * 16 + 8 * half + p) * 32, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(vv + ((2 * c + 1) * 16 + 8 * half + p) * 32, _mm512_permutex2var_epi16(a, hi, b));
    }
}

// The chunk's scores of row group `x` (rows x .. x+15 of the padded buffers), S^T for up to 32 keys: sub-block i's
// keys at k[i] (stride ks[i] bytes), into s (32 keys x 16 rows).
inline void scores_amx(const Tile& t, const AmxBuffers& b, int64_t x, const uint16_t* const* k, const int64_t* ks,
                       bool two, float* s) {
  const int64_t D = t.head_dim;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t c = 0; c < D / 32; ++c) {
    _tile_loadd(5, b.qt + (x / 16 * (D / 32) + c) * 256, 64);
    _tile_loadd(4, k[0] + 32 * c, ks[0]);
    _tile_dpbf16ps(0, 4, 5);
    if (two) {
      _tile_loadd(6, k[1] + 32 * c, ks[1]);
      _tile_dpbf16ps(1, 6, 5);
    }
  }
  _tile_stored(0, s, 64);
  _tile_stored(1, s + 256, 64);
}

// The online softmax of row group x over the chunk's scores s: updates m, l and (where a row's maximum moved) acc,
// and writes the weights P (16 rows x 32 keys, bf16) to p.
template <typename CT>
inline void softmax_group(const Tile& t, const AmxBuffers& b, int64_t x, const SubBlock* sb, const float* s,
                          uint16_t* p) {
  const int64_t D = t.head_dim;
  // Keys a row may see: key position <= its position. Padding rows (position -1) and keys past nk see nothing.
  const __m512i pos = _mm512_loadu_si512(b.pos + x);
  const int64_t last = sb[1].nk > 0 ? sb[1].kp0 + sb[1].nk - 1 : sb[0].kp0 + sb[0].nk - 1;
  const bool causal = last > _mm512_reduce_min_epi32(pos);
  __m512 e[32];
  __mmask16 seen[32];
  const __m512 m_old = _mm512_load_ps(b.m + x);
  __m512 mx = m_old;
  for (int j = 0; j < 32; ++j) {
    const SubBlock& sj = sb[j / 16];
    const int64_t jj = j % 16;
    seen[j] = jj >= sj.nk ? 0 : causal ? _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(sj.kp0 + jj)) : 0xFFFF;
    e[j] = _mm512_mask_mul_ps(_mm512_set1_ps(kMinScore), seen[j], _mm512_load_ps(s + 16 * j),
                              _mm512_set1_ps(b.kscale[j]));
    mx = _mm512_max_ps(mx, e[j]);
  }
  const __mmask16 moved = _mm512_cmpneq_ps_mask(mx, m_old);
  const __m512 corr = exp2_512(_mm512_sub_ps(m_old, mx));  // 0 where m_old is still kMinScore
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < 32; ++j) {
    e[j] = _mm512_maskz_mov_ps(seen[j], exp2_512(_mm512_sub_ps(e[j], mx)));
    sum = _mm512_add_ps(sum, e[j]);
    if constexpr (is_8bit_v<CT>) e[j] = _mm512_mul_ps(e[j], _mm512_set1_ps(b.vscale[j]));  // P's columns, not l
  }
  _mm512_store_ps(b.m + x, mx);
  _mm512_store_ps(b.l + x, _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(b.l + x), corr), sum));
  float* acc = b.acc + x * D;
  if (moved) {
    alignas(64) float c[16];
    _mm512_store_ps(c, corr);
    for (int r = 0; r < 16; ++r) {
      if (!((moved >> r) & 1)) continue;
      const __m512 cr = _mm512_set1_ps(c[r]);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_store_ps(acc + r * D + d, _mm512_mul_ps(_mm512_load_ps(acc + r * D + d), cr));
    }
  }
  // P (16 rows x 32 keys, bf16): pair k of keys 2k, 2k+1 as one dword per row (q[k]), then a 16 x 16 dword
  // transpose gives each row's 16 pairs in key order.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 q[16], w[16];
  for (int k = 0; k < 16; ++k)
    q[k] = _mm512_castsi512_ps(_mm512_permutexvar_epi16(
        interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e[2 * k + 1], e[2 * k]))));
  transpose16(q, w);
  for (int r = 0; r < 16; ++r) _mm512_store_ps(reinterpret_cast<float*>(p + 32 * r), w[r]);
}

// acc += P V for row group x: P in p, the chunk's values in b.vv.
inline void values_amx(const Tile& t, const AmxBuffers& b, int64_t x, const uint16_t* p) {
  const int64_t D = t.head_dim;
  float* acc = b.acc + x * D;
  _tile_loadd(6, p, 64);
  for (int64_t i = 0; i < D / 16; ++i) {
    _tile_loadd(0, acc + 16 * i, D * 4);
    _tile_loadd(7, b.vv + i * 512, 64);
    _tile_dpbf16ps(0, 6, 7);
    _tile_stored(0, acc + 16 * i, D * 4);
  }
}

// attend_tile for the AMX case: writes the tile's float32 outputs to o (rows x head_dim), and when lse is set
// their log-sum-exps. Keys go in chunks of two sub-blocks (up to 32 keys): P is a full 16 x 32 A tile.
template <typename CT>
void attend_tile_amx(const Tile& t, float* o, float* lse, std::vector<float>& work) {
  const int64_t D = t.head_dim, rph = rows_per_head(t), padded_rph = (rph + 15) / 16 * 16;
  const AmxBuffers b = amx_buffers(t, work);
  prepare_rows(t, b, padded_rph);
  const TileConfig cfg;
  _tile_loadconfig(&cfg);
  SubBlock sb[2];
  auto attend_chunk = [&] {
    for (int64_t h = 0; h < t.kv_heads; ++h) {
      const uint16_t* k[2];
      int64_t ks[2];
      for (int i = 0; i < 2; ++i) {
        k[i] = key_rows<CT>(t, b, h, sb[i], i, ks[i]);
        values_to_tiles<CT>(t, h, sb[i], i, b.vv);
      }
      // In phases over the head's row groups, so that no tile load waits on the stores just before it.
      const int64_t x0 = h * padded_rph;
      for (int64_t g = 0; g < rph; g += 16) scores_amx(t, b, x0 + g, k, ks, sb[1].nk > 0, b.s + g * 32);
      for (int64_t g = 0; g < rph; g += 16) softmax_group<CT>(t, b, x0 + g, sb, b.s + g * 32, b.p + g * 32);
      for (int64_t g = 0; g < rph; g += 16) values_amx(t, b, x0 + g, b.p + g * 32);
    }
    sb[0] = sb[1] = SubBlock{};
  };
  for_each_sub_block(t, [&](int64_t kp0, int64_t nk, int64_t slot0) {
    (sb[0].nk == 0 ? sb[0] : sb[1]) = SubBlock{kp0, nk, slot0};
    if (sb[1].nk > 0) attend_chunk();
  });
  if (sb[0].nk > 0) attend_chunk();
  _tile_release();
  if (lse != nullptr)  // maxima back to natural units for the log-sum-exps
    for (int64_t r = 0; r < t.kv_heads * padded_rph; ++r) b.m[r] *= 1.f / kLog2e;
  for (int64_t h = 0; h < t.kv_heads; ++h)
    normalize_rows(b.acc + h * padded_rph * D, b.m + h * padded_rph, b.l + h * padded_rph, rph, D, o + h * rph * D,
                   lse != nullptr ? lse + h * rph : nullptr);
}
