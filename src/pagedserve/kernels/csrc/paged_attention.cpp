// Paged attention for CPU: float32 or bf16 queries, a float32, bf16, int8 or fp8 e4m3 KV cache (8-bit rows carry
// their scale: kv_types.h), float32 arithmetic (in the amx variant, bf16 prefill tiles multiply on AMX tiles with
// float32 sums: attention_amx.h). Registered as torch.ops.pagedserve_<isa>.* (ops_library.h); built on first use by
// pagedserve/kernels/__init__.py through torch.utils.cpp_extension and cached. Threads come from ATen's
// pool (at::parallel_for), so they follow torch.set_num_threads and never oversubscribe it; a call with little
// work (decode at short contexts) runs on the calling thread alone (kSerialWork).
//
// paged_attention reads K/V in place through block tables: no per-request copies. One work item is a
// tile of up to kTileQ query tokens of one sequence (x its kv heads); its rows are the tile's tokens x
// the query heads, and it walks the sequence's blocks once with an online softmax:
//
//   for each block b (only up to the tile's last causal position):
//     s[r][j] = scale * q_r . k_j          (only keys at or before row r's position)
//     m_r' = max(m_r, max_j s[r][j]);  l_r = l_r * e^(m_r - m_r') + sum_j e^(s[r][j] - m_r')
//     acc_r = acc_r * e^(m_r - m_r') + sum_j e^(s[r][j] - m_r') v_j
//   out_r = acc_r / l_r
//
// Shared prefixes (cascade attention): decode sequences next to each other in the batch whose block tables
// begin with the same blocks (prefix caching, parallel sampling) read those blocks once, together: one tile
// holds the group's query rows against each chunk of the shared blocks, and each sequence walks only its
// own blocks after them. Each part leaves float32 outputs and log-sum-exps, merged per row at the end:
//   out_r = sum_p e^(lse_p - M) o_p / sum_p e^(lse_p - M),  M = max_p lse_p
// Decode attention reads each key once per query token otherwise, and is bound by memory bandwidth.
//
// paged_attention_windowed adds a sliding window (a row at position p sees keys p - window + 1 .. p; a tile walks
// from its first row's first visible key, masking each row's keys before its own window) and Gemma 2's score cap
// (s = cap * tanh(s / cap)); windowed and capped tiles run the AVX-512 paths as plain ones do, prefill tiles the
// transposed one (attention_tile.h; batch-invariant windowed tiles the portable path), and no prefix is shared.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "attention_tile.h"
#include "checks.h"
#include "kv_types.h"
#include "ops_library.h"

namespace {

constexpr int64_t kTileQ = 16;

// A shared prefix is worth its merge from this many blocks on; a shared tile walks at most kChunkBlocks
// blocks (so that the group's work splits across threads).
constexpr int64_t kMinSharedBlocks = 4;
constexpr int64_t kChunkBlocks = 16;

constexpr const char* kOp = "paged_attention";

// A call with less work than this (work_estimate: about 0.2 ns each on one AVX-512 core, so some 200 us) runs on
// the calling thread alone. Waking another thread costs ~10 us on an idle machine, and a scheduler time slice
// (milliseconds) when the other cores are busy: on a 2-vCPU host decode attention at a 10-token context took
// 3.75 ms per call (issue 25) for 10 us of work. On 2 vCPUs that are one core's hyperthreads a split gains
// little, so the bound leans to one thread: single-stream decode of a 1B model stays on it to ~300 tokens.
constexpr int64_t kSerialWork = int64_t{1} << 20;

// The kernel's work for the sequences it attends: per query tile, keys walked x kv heads x head_dim x (2 + the
// tile's rows per kv head) (reading K and V, and the rows' dot products and weighted sums).
template <typename F>
int64_t work_estimate(const int64_t* qsl, const int64_t* lens, int64_t num_seqs, int64_t num_kv_heads,
                      int64_t head_dim, int64_t group, F&& in_kernel) {
  int64_t work = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    if (!in_kernel(i)) continue;
    const int64_t q_len = qsl[i + 1] - qsl[i], tiles = (q_len + kTileQ - 1) / kTileQ;
    work += tiles * lens[i] * num_kv_heads * head_dim * (2 + std::min(q_len, kTileQ) * group);
  }
  return work;
}

// Shapes, dtypes and layouts; then query_start_loc, seq_lens and the used block-table entries, so that
// every offset the kernel computes below stays inside its tensor. O(num_seqs + blocks used + tokens).
void check_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                  const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  const at::Tensor& query_start_loc) {
  using pagedserve::check_tensor;
  using pagedserve::Layout;
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16, kOp,
              ": query must be Float or BFloat16, got ", query.scalar_type());
  check_tensor(query, kOp, "query", query.scalar_type(), 3, Layout::kRows);
  check_tensor(key, kOp, "key", query.scalar_type(), 3, Layout::kRows);
  check_tensor(value, kOp, "value", query.scalar_type(), 3, Layout::kRows);
  const at::ScalarType cache_type = kv_cache.scalar_type();
  const bool eight_bit = cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn;
  TORCH_CHECK(eight_bit || cache_type == at::kFloat || cache_type == at::kBFloat16, kOp,
              ": kv_cache must be Float, BFloat16, Char (int8) or Float8_e4m3fn, got ", cache_type);
  check_tensor(kv_cache, kOp, "kv_cache", cache_type, 5, Layout::kContiguous);
  check_tensor(slot_mapping, kOp, "slot_mapping", at::kLong, 1, Layout::kContiguous);
  check_tensor(block_tables, kOp, "block_tables", at::kLong, 2, Layout::kContiguous);
  check_tensor(seq_lens, kOp, "seq_lens", at::kLong, 1, Layout::kContiguous);
  check_tensor(query_start_loc, kOp, "query_start_loc", at::kLong, 1, Layout::kContiguous);

  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  TORCH_CHECK(kv_cache.size(0) == 2, kOp, ": kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
              "got shape ", kv_cache.sizes());
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(block_size > 0, kOp, ": kv_cache block_size must be positive, got shape ", kv_cache.sizes());
  // An 8-bit row is head_dim codes and the 4 bytes of its float32 scale.
  const int64_t width = head_dim + (eight_bit ? pagedserve::kScaleBytes : 0);
  TORCH_CHECK(head_dim > 0 && kv_cache.size(4) == width, kOp, ": head size mismatch: query head_dim ", head_dim,
              " needs kv_cache rows of ", width, " ", cache_type, " elements, got ", kv_cache.size(4));
  TORCH_CHECK(num_kv_heads > 0 && num_heads > 0 && num_heads % num_kv_heads == 0, kOp, ": query heads (", num_heads,
              ") must be a positive multiple of kv_cache kv heads (", num_kv_heads, ")");
  for (const auto* kv : {&key, &value}) {
    const char* name = kv == &key ? "key" : "value";
    TORCH_CHECK(kv->size(0) == num_tokens && kv->size(1) == num_kv_heads && kv->size(2) == head_dim, kOp, ": ", name,
                " must be [num_tokens, num_kv_heads, head_dim] = [", num_tokens, ", ", num_kv_heads, ", ", head_dim,
                "], got ", kv->sizes());
  }
  TORCH_CHECK(slot_mapping.numel() == num_tokens, kOp, ": slot_mapping must have one slot per query token (",
              num_tokens, "), got ", slot_mapping.numel());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_blocks * block_size, kOp, ": slot_mapping[", t, "] = ", slots[t],
                " outside the kv_cache's ", num_blocks * block_size, " slots");

  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(query_start_loc.numel() == num_seqs + 1, kOp, ": query_start_loc must have num_seqs + 1 = ",
              num_seqs + 1, " entries, got ", query_start_loc.numel());
  // Extra rows (a persistent table sliced by the caller or not) are never read.
  TORCH_CHECK(block_tables.size(0) >= num_seqs, kOp, ": block_tables must have a row per sequence (", num_seqs,
              "), got ", block_tables.size(0));
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t table_width = block_tables.size(1);
  TORCH_CHECK(qsl[0] == 0, kOp, ": query_start_loc[0] must be 0, got ", qsl[0]);
  TORCH_CHECK(qsl[num_seqs] == num_tokens, kOp, ": query_start_loc[-1] = ", qsl[num_seqs],
              " must equal the number of query tokens (", num_tokens, ")");
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(qsl[i + 1] >= qsl[i], kOp, ": query_start_loc must be non-decreasing, got ", qsl[i], " then ",
                qsl[i + 1], " at sequence ", i);
    const int64_t q_len = qsl[i + 1] - qsl[i];  // in [0, num_tokens]: qsl starts at 0, ends at num_tokens
    TORCH_CHECK(lens[i] >= q_len, kOp, ": seq_lens[", i, "] = ", lens[i], " is shorter than its query length ",
                q_len);
    const int64_t used = lens[i] == 0 ? 0 : (lens[i] - 1) / block_size + 1;  // no overflow for huge lens
    TORCH_CHECK(used <= table_width, kOp, ": block_tables is ", table_width, " blocks wide but seq_lens[", i, "] = ", lens[i],
                " needs ", used, " blocks of ", block_size);
    const int64_t* row = tables + i * table_width;
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(row[b] >= 0 && row[b] < num_blocks, kOp, ": block_tables[", i, "][", b, "] = ", row[b],
                  " outside the kv_cache's ", num_blocks, " blocks");
  }
}

// A run of consecutive decode sequences (one query token each), seq0 .. seq0+n-1, whose block tables begin
// with the same `blocks` blocks, all wholly before every member's query token.
struct SharedPrefix {
  int64_t seq0, n, blocks;
};

// The runs worth sharing: at least two sequences, at least kMinSharedBlocks blocks. A run grows while the
// next sequence keeps kMinSharedBlocks of the common blocks; its prefix is what all members have in common.
std::vector<SharedPrefix> shared_prefixes(const int64_t* qsl, const int64_t* lens, const int64_t* tables,
                                          int64_t table_width, int64_t num_seqs, int64_t block_size) {
  std::vector<SharedPrefix> groups;
  auto decode = [&](int64_t i) { return qsl[i + 1] - qsl[i] == 1; };
  for (int64_t i = 0; i < num_seqs;) {
    if (!decode(i)) {
      ++i;
      continue;
    }
    const int64_t* first = tables + i * table_width;
    int64_t common = (lens[i] - 1) / block_size, j = i + 1;
    for (; j < num_seqs && decode(j); ++j) {
      const int64_t* row = tables + j * table_width;
      const int64_t limit = std::min(common, (lens[j] - 1) / block_size);
      int64_t k = 0;
      while (k < limit && row[k] == first[k]) ++k;
      if (k < kMinSharedBlocks) break;
      common = k;
    }
    if (j - i >= 2) groups.push_back({i, j - i, common});
    i = j;
  }
  return groups;
}

// Writes this step's K/V at slot_mapping, then attends every sequence whose query length is at most
// max_q_len (all of them when max_q_len < 0). Rows of longer sequences are left for the caller.
// QT: query/key/value/output element type; CT: cache element type (kv_types.h).
template <typename QT, typename CT>
at::Tensor paged_attention_typed(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                                 int64_t max_q_len, int64_t window, double softcap, bool invariant) {
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_bytes = pagedserve::row_bytes<CT>(head_dim), slot_bytes = num_kv_heads * row_bytes;
  uint8_t* k_cache = static_cast<uint8_t*>(kv_cache.data_ptr());
  uint8_t* v_cache = k_cache + kv_cache.stride(0) * kv_cache.element_size();

  const int64_t num_seqs = seq_lens.numel();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  auto in_kernel = [&](int64_t i) {
    const int64_t q_len = qsl[i + 1] - qsl[i];
    return q_len > 0 && (max_q_len < 0 || q_len <= max_q_len);
  };
  const int64_t num_threads =
      work_estimate(qsl, lens, num_seqs, num_kv_heads, head_dim, group, in_kernel) < kSerialWork
          ? 1 : at::get_num_threads();
  // at::parallel_for's grain: the whole range (on this thread) for a small call.
  auto grain = [&](int64_t n, int64_t g) { return num_threads == 1 ? std::max<int64_t>(n, 1) : g; };

  // 1. Write K/V (a token sees its own key), quantizing for an 8-bit cache.
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const QT* kp = static_cast<const QT*>(key.data_ptr());
  const QT* vp = static_cast<const QT*>(value.data_ptr());
  // (Rows go at least 1,024 per thread: a thread woken for fewer costs more than their copies.)
  const int64_t num_rows = num_tokens * num_kv_heads;
  at::parallel_for(0, num_rows, grain(num_rows, 1024), [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = w / num_kv_heads, h = w % num_kv_heads;
      const int64_t dst = slots[t] * slot_bytes + h * row_bytes;
      pagedserve::store_row<QT, CT>(kp + t * key.stride(0) + h * key.stride(1), head_dim, k_cache + dst);
      pagedserve::store_row<QT, CT>(vp + t * value.stride(0) + h * value.stride(1), head_dim, v_cache + dst);
    }
  });

  // 2. Work items: one Tile each (attention_tile.h).
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t table_width = block_tables.size(1);
  // A window or a soft cap: no shared parts (a shared prefix's keys may be outside a member's window); batch-
  // invariant: none either (a merged part sums a row's keys in another order than walking them).
  const std::vector<SharedPrefix> groups =
      max_q_len == 0 || window > 0 || softcap > 0 || invariant
          ? std::vector<SharedPrefix>{} : shared_prefixes(qsl, lens, tables, table_width, num_seqs, block_size);
  at::Tensor out = at::empty({num_tokens, num_heads, head_dim}, query.options());
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const QT* q_base = static_cast<const QT*>(query.data_ptr());
  QT* o_base = static_cast<QT*>(out.data_ptr());
  // A tile of n_q tokens from token tok0 (of sequence seq, whose block table it reads), kv heads h .. h+nh-1.
  auto make_tile = [&](int64_t seq, int64_t tok0, int64_t n_q, int64_t h, int64_t nh) {
    pagedserve::Tile t;
    t.q = q_base + tok0 * q_s0 + h * group * q_s1;
    t.q_tok_stride = q_s0;
    t.q_head_stride = q_s1;
    t.out = o_base + tok0 * out.stride(0) + h * group * out.stride(1);
    t.o_tok_stride = out.stride(0);
    t.o_head_stride = out.stride(1);
    t.k_cache = k_cache + h * row_bytes;
    t.v_cache = v_cache + h * row_bytes;
    t.slot_bytes = slot_bytes;
    t.row_bytes = row_bytes;
    t.table = tables + seq * table_width;
    t.block_size = block_size;
    t.head_dim = head_dim;
    t.group = group;
    t.kv_heads = nh;
    t.pos0 = lens[seq] - (qsl[seq + 1] - qsl[seq]) + (tok0 - qsl[seq]);
    t.n_q = n_q;
    t.scale = static_cast<float>(scale);
    t.key_end = t.pos0 + n_q;
    t.window = window;
    t.softcap = static_cast<float>(softcap);
    t.invariant = invariant;
    return t;
  };
  std::vector<pagedserve::Tile> items;
  // Shared parts first (the longest items, for the dynamic schedule below). Group g's partial results:
  // parts[g] = (chunks + 1) slots x n tokens x num_heads rows of head_dim floats (slot `chunks`: the sequences'
  // own blocks), and as many log-sum-exps.
  std::vector<std::vector<float>> parts(groups.size()), lses(groups.size());
  std::vector<bool> grouped(num_seqs, false);
  const int64_t row_floats = num_heads * head_dim;
  for (size_t g = 0; g < groups.size(); ++g) {
    const SharedPrefix& sp = groups[g];
    const int64_t chunks = (sp.blocks + kChunkBlocks - 1) / kChunkBlocks;
    parts[g].resize((chunks + 1) * sp.n * row_floats);
    lses[g].resize((chunks + 1) * sp.n * num_heads);
    auto as_part = [&](pagedserve::Tile& t, int64_t slot, int64_t member, int64_t h) {
      t.part = parts[g].data() + (slot * sp.n + member) * row_floats + h * group * head_dim;
      t.o_tok_stride = row_floats;
      t.o_head_stride = head_dim;
      t.lse = lses[g].data() + (slot * sp.n + member) * num_heads + h * group;
      t.lse_tok_stride = num_heads;
    };
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t m0 = 0; m0 < sp.n; m0 += kTileQ)
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          // Every row sees every key of the chunk: as if the tile's first token sat at the chunk's last key.
          pagedserve::Tile t = make_tile(sp.seq0, qsl[sp.seq0] + m0, std::min(kTileQ, sp.n - m0), h, 1);
          t.key_begin = c * kChunkBlocks * block_size;
          t.key_end = std::min((c + 1) * kChunkBlocks, sp.blocks) * block_size;
          t.pos0 = t.key_end - 1;
          as_part(t, c, m0, h);
          items.push_back(t);
        }
    for (int64_t m = 0; m < sp.n; ++m) {
      const int64_t seq = sp.seq0 + m;
      grouped[seq] = true;
      pagedserve::Tile t = make_tile(seq, qsl[seq], 1, 0, num_kv_heads);
      t.key_begin = sp.blocks * block_size;
      as_part(t, chunks, m, 0);
      items.push_back(t);
    }
  }
  // The other sequences: tiles of up to kTileQ tokens, x all kv heads, so that a work item streams each
  // block's rows contiguously; with too few tiles to keep every thread busy (single-stream decode) the heads
  // are split across items instead.
  int64_t num_tiles = 0;
  for (int64_t i = 0; i < num_seqs; ++i)
    if (in_kernel(i) && !grouped[i]) num_tiles += (qsl[i + 1] - qsl[i] + kTileQ - 1) / kTileQ;
  const int64_t heads_per_item = num_tiles >= 2 * num_threads ? num_kv_heads : 1;
  for (int64_t i = 0; i < num_seqs; ++i) {
    if (!in_kernel(i) || grouped[i]) continue;
    const int64_t q_len = qsl[i + 1] - qsl[i];
    for (int64_t j = 0; j < q_len; j += kTileQ)
      for (int64_t h = 0; h < num_kv_heads; h += heads_per_item)
        items.push_back(make_tile(i, qsl[i] + j, std::min(kTileQ, q_len - j), h, heads_per_item));
  }
#if defined(PAGEDSERVE_AMX)
  if constexpr (pagedserve::amx_types_v<QT, CT>) pagedserve::require_tile_state(kOp);
#endif
  // Each thread takes the next item until none is left.
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(num_items, num_threads), 1, [&](int64_t, int64_t) {
    pagedserve::TileScratch scratch;
    for (int64_t w = next++; w < num_items; w = next++) pagedserve::attend_tile<QT, CT>(items[w], scratch);
  });

  // 3. Merge each grouped token's parts into out.
  for (size_t g = 0; g < groups.size(); ++g) {
    const SharedPrefix& sp = groups[g];
    const int64_t slots = (sp.blocks + kChunkBlocks - 1) / kChunkBlocks + 1;
    at::parallel_for(0, sp.n * num_heads, grain(sp.n * num_heads, 16), [&](int64_t begin, int64_t end) {
      std::vector<float> acc(head_dim);
      for (int64_t w = begin; w < end; ++w) {
        const int64_t m = w / num_heads, hq = w % num_heads;
        float top = pagedserve::kMinScore;
        for (int64_t p = 0; p < slots; ++p) top = std::max(top, lses[g][(p * sp.n + m) * num_heads + hq]);
        std::fill(acc.begin(), acc.end(), 0.f);
        float total = 0.f;
        for (int64_t p = 0; p < slots; ++p) {
          const float wp = std::exp(lses[g][(p * sp.n + m) * num_heads + hq] - top);
          const float* o = parts[g].data() + (p * sp.n + m) * row_floats + hq * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += wp * o[d];
          total += wp;
        }
        QT* dst = o_base + qsl[sp.seq0 + m] * out.stride(0) + hq * out.stride(1);
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = pagedserve::from_float<QT>(acc[d] / total);
      }
    });
  }
  return out;
}

template <typename QT>
at::Tensor paged_attention_q(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                             int64_t max_q_len, int64_t window, double softcap, bool invariant) {
  using pagedserve::bf16_t;
  using pagedserve::fp8_e4m3_t;
  switch (kv_cache.scalar_type()) {
    case at::kFloat:
      return paged_attention_typed<QT, float>(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens,
                                              query_start_loc, scale, max_q_len, window, softcap, invariant);
    case at::kBFloat16:
      return paged_attention_typed<QT, bf16_t>(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens,
                                               query_start_loc, scale, max_q_len, window, softcap, invariant);
    case at::kChar:
      return paged_attention_typed<QT, int8_t>(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens,
                                               query_start_loc, scale, max_q_len, window, softcap, invariant);
    default:  // Float8_e4m3fn (check_inputs admits nothing else)
      return paged_attention_typed<QT, fp8_e4m3_t>(query, key, value, kv_cache, slot_mapping, block_tables,
                                                   seq_lens, query_start_loc, scale, max_q_len, window,
                                                   softcap, invariant);
  }
}

// window > 0: each query sees the last `window` positions, itself included; softcap > 0: Gemma 2's score cap;
// invariant (batch_invariant): each query's output is the same whatever else the call attends (attention_tile.h).
at::Tensor paged_attention_windowed(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                    at::Tensor kv_cache, const at::Tensor& slot_mapping,
                                    const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                    const at::Tensor& query_start_loc, double scale, int64_t max_q_len,
                                    int64_t window, double softcap, bool invariant) {
  // Everything is checked before the first write: a rejected call leaves kv_cache untouched.
  check_inputs(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc);
  TORCH_CHECK(window >= 0 && softcap >= 0, kOp, ": window and softcap must be >= 0 (0: none), got ", window,
              " and ", softcap);
  if (query.scalar_type() == at::kBFloat16)
    return paged_attention_q<pagedserve::bf16_t>(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens,
                                                 query_start_loc, scale, max_q_len, window, softcap, invariant);
  return paged_attention_q<float>(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens,
                                  query_start_loc, scale, max_q_len, window, softcap, invariant);
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           at::Tensor kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                           int64_t max_q_len) {
  return paged_attention_windowed(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens,
                                  query_start_loc, scale, max_q_len, 0, 0.0, false);
}

// The runs paged_attention shares, as rows (first sequence, sequences, blocks): for tests and benchmarks.
at::Tensor shared_prefix_groups(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& query_start_loc, int64_t block_size) {
  using pagedserve::check_tensor;
  using pagedserve::Layout;
  constexpr const char* op = "shared_prefix_groups";
  check_tensor(block_tables, op, "block_tables", at::kLong, 2, Layout::kContiguous);
  check_tensor(seq_lens, op, "seq_lens", at::kLong, 1, Layout::kContiguous);
  check_tensor(query_start_loc, op, "query_start_loc", at::kLong, 1, Layout::kContiguous);
  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(block_size > 0 && query_start_loc.numel() == num_seqs + 1 && block_tables.size(0) >= num_seqs, op,
              ": needs block_size > 0, num_seqs + 1 query_start_loc entries and a block_tables row per sequence");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_seqs; ++i)
    TORCH_CHECK(lens[i] >= 1 && (lens[i] - 1) / block_size < block_tables.size(1), op, ": seq_lens[", i, "] = ",
                lens[i], " does not fit block_tables");
  const auto groups = shared_prefixes(query_start_loc.data_ptr<int64_t>(), lens, block_tables.data_ptr<int64_t>(),
                                      block_tables.size(1), num_seqs, block_size);
  at::Tensor out = at::empty({static_cast<int64_t>(groups.size()), 3}, seq_lens.options());
  int64_t* o = out.data_ptr<int64_t>();
  for (const SharedPrefix& g : groups) *o++ = g.seq0, *o++ = g.n, *o++ = g.blocks;
  return out;
}

}  // namespace

PAGEDSERVE_LIBRARY(m) {
  m.def("paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int max_q_len) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, paged_attention);
  m.def("paged_attention_windowed(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int max_q_len, int window, "
        "float softcap, bool batch_invariant=False) -> Tensor");
  m.impl("paged_attention_windowed", c10::DispatchKey::CPU, paged_attention_windowed);
  m.def("shared_prefix_groups(Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int block_size) "
        "-> Tensor", &shared_prefix_groups);
  m.def("compiled_isa() -> str", &pagedserve::compiled_isa);
}
