// GGUF block formats as they lie in the file: each weight row is a run of blocks along the input dimension,
// and a block rebuilds `Elems` float32 weights from `Bytes` bytes. Types are GGML's ids (gguf-py's
// GGMLQuantizationType). The formulas follow ggml's reference dequantizers in the same arithmetic order,
// so a block rebuilds the very floats gguf.quants.dequantize returns: every product below is exact in
// float32 (an fp16 scale times a small integer) except Q6_K's (d * scale) * q and IQ4_XS's
// (d * scale) * value, computed in that order.
//
//   Q4_0  [d f16][16 B: q[j] | q[j+16] << 4]                     w = d * (q - 8)
//   Q4_1  [d f16][m f16][16 B nibbles]                           w = d * q + m
//   Q5_0  [d f16][qh u32: 5th bits][16 B nibbles]                w = d * (q - 16)
//   Q5_1  [d f16][m f16][qh u32][16 B nibbles]                   w = d * q + m
//   Q8_0  [d f16][32 x int8]                                     w = d * q
//   Q4_K  256: [d f16][dmin f16][12 B: 8 x (6-bit scale, 6-bit min)][128 B nibbles]
//                                                                w = (d * sc) * q - dmin * mn, per 32
//   Q5_K  256: as Q4_K plus [32 B: 5th bits] before the nibbles
//   Q6_K  256: [128 B low nibbles][64 B: 2 high bits][16 x int8 scales][d f16]   w = (d * sc) * (q - 32), per 16
//   IQ4_XS 256: [d f16][scales_h u16: 8 x 2 high bits][scales_l 4 B: 8 x 4 low bits][128 B nibbles]
//                                        w = (d * (sc - 32)) * kIq4Values[q], per 32 (sub-block j: bytes 16j..16j+15,
//                                        low nibbles weights 0-15, high nibbles 16-31)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "checks.h"

namespace pagedserve::gguf {

enum Type : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
                     kIQ4_XS = 23 };

template <int64_t T>
struct Format;
template <> struct Format<kQ4_0> { static constexpr int64_t kElems = 32, kBytes = 18; };
template <> struct Format<kQ4_1> { static constexpr int64_t kElems = 32, kBytes = 20; };
template <> struct Format<kQ5_0> { static constexpr int64_t kElems = 32, kBytes = 22; };
template <> struct Format<kQ5_1> { static constexpr int64_t kElems = 32, kBytes = 24; };
template <> struct Format<kQ8_0> { static constexpr int64_t kElems = 32, kBytes = 34; };
template <> struct Format<kQ4_K> { static constexpr int64_t kElems = 256, kBytes = 144; };
template <> struct Format<kQ5_K> { static constexpr int64_t kElems = 256, kBytes = 176; };
template <> struct Format<kQ6_K> { static constexpr int64_t kElems = 256, kBytes = 210; };
template <> struct Format<kIQ4_XS> { static constexpr int64_t kElems = 256, kBytes = 136; };

// (elements, bytes) per block, or (0, 0) for a type without a kernel.
inline void block_shape(int64_t type, int64_t& elems, int64_t& bytes) {
  switch (type) {
    case kQ4_0: elems = 32, bytes = 18; return;
    case kQ4_1: elems = 32, bytes = 20; return;
    case kQ5_0: elems = 32, bytes = 22; return;
    case kQ5_1: elems = 32, bytes = 24; return;
    case kQ8_0: elems = 32, bytes = 34; return;
    case kQ4_K: elems = 256, bytes = 144; return;
    case kQ5_K: elems = 256, bytes = 176; return;
    case kQ6_K: elems = 256, bytes = 210; return;
    case kIQ4_XS: elems = 256, bytes = 136; return;
    default: elems = 0, bytes = 0;
  }
}

// The input features K of w's rows: whole blocks of `type`, checked.
inline int64_t features(const at::Tensor& w, int64_t type, const char* op) {
  pagedserve::check_tensor(w, op, "w", at::kByte, 2, pagedserve::Layout::kContiguous);
  int64_t elems, bytes;
  block_shape(type, elems, bytes);
  TORCH_CHECK(elems > 0, op, ": GGML type ", type, " has no kernel; supported: Q4_0 (2), Q4_1 (3), Q5_0 (6), ",
              "Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14), IQ4_XS (23)");
  TORCH_CHECK(w.size(1) > 0 && w.size(1) % bytes == 0, op, ": a row of w must be whole blocks of ", bytes,
              " bytes for type ", type, ", got ", w.size(1), " bytes");
  return w.size(1) / bytes * elems;
}

// A block GEMM's inputs checked (gemm_gguf, gemm_gguf_int8): x [M, K] Float or BFloat16 with contiguous rows,
// w [N, row_bytes] whole blocks of K weights per row, bias [N] of Float or x's dtype or none. Returns K; the
// bias as contiguous float32 in bias32 (left undefined for none).
inline int64_t check_gemm(const at::Tensor& x, const at::Tensor& w, int64_t type,
                          const c10::optional<at::Tensor>& bias, const char* op, at::Tensor& bias32) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be Float or BFloat16, got ", x.scalar_type());
  pagedserve::check_tensor(x, op, "x", x.scalar_type(), 2, pagedserve::Layout::kRows);
  const int64_t k = features(w, type, op), n = w.size(0);
  TORCH_CHECK(x.size(1) == k, op, ": x has ", x.size(1), " features, the weight's rows hold ", k);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() || bias->scalar_type() == at::kFloat, op,
                ": bias must be Float or x's dtype, got ", bias->scalar_type());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias has ", bias->numel(), " entries, the weight has ",
                n, " rows");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  return k;
}

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_K / Q5_K: sub-block j's 6-bit scale and min, packed into 12 bytes (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// IQ4_XS's (and IQ4_NL's) 16 non-linear values a nibble stands for.
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// IQ4_XS: sub-block j's scale minus 32, from 4 low bits in scales_l and 2 high bits in scales_h.
inline int iq4xs_scale(int j, const uint8_t* b) {
  const int high = ((b[2] | (b[3] << 8)) >> (2 * j)) & 3;
  return (((b[4 + j / 2] >> (4 * (j & 1))) & 15) | (high << 4)) - 32;
}

template <int64_t T>
inline void dequant_block(const uint8_t* b, float* w) {
  if constexpr (T == kQ4_0 || T == kQ4_1) {
    const float d = f16(b), m = T == kQ4_1 ? f16(b + 2) : 0.f;
    const uint8_t* qs = b + (T == kQ4_1 ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      if constexpr (T == kQ4_0) {
        w[j] = d * static_cast<float>((qs[j] & 15) - 8);
        w[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
      } else {
        w[j] = d * static_cast<float>(qs[j] & 15) + m;
        w[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
      }
    }
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    const float d = f16(b), m = T == kQ5_1 ? f16(b + 2) : 0.f;
    const uint32_t qh = u32(b + (T == kQ5_1 ? 4 : 2));
    const uint8_t* qs = b + (T == kQ5_1 ? 8 : 6);
    for (int j = 0; j < 16; ++j) {
      const int x0 = (qs[j] & 15) | (((qh >> j) << 4) & 0x10);
      const int x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
      if constexpr (T == kQ5_0) {
        w[j] = d * static_cast<float>(x0 - 16);
        w[j + 16] = d * static_cast<float>(x1 - 16);
      } else {
        w[j] = d * static_cast<float>(x0) + m;
        w[j + 16] = d * static_cast<float>(x1) + m;
      }
    }
  } else if constexpr (T == kQ8_0) {
    const float d = f16(b);
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(qs[j]);
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;  // Q5_K only
    const uint8_t* qs = b + (T == kQ5_K ? 48 : 16);
    for (int c = 0; c < 4; ++c) {  // 64 weights: 32 low nibbles, then 32 high nibbles of the same bytes
      int sc, mn;
      scale_min_k4(2 * c, scales, sc, mn);
      const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(mn);
      scale_min_k4(2 * c + 1, scales, sc, mn);
      const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(mn);
      const uint8_t* q = qs + 32 * c;
      float* y = w + 64 * c;
      for (int l = 0; l < 32; ++l) {
        int lo = q[l] & 15, hi = q[l] >> 4;
        if constexpr (T == kQ5_K) {
          lo += ((qh[l] >> (2 * c)) & 1) << 4;
          hi += ((qh[l] >> (2 * c + 1)) & 1) << 4;
        }
        y[l] = d1 * static_cast<float>(lo) - m1;
        y[l + 32] = d2 * static_cast<float>(hi) - m2;
      }
    }
  } else if constexpr (T == kQ6_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    float ds[16];
    for (int i = 0; i < 16; ++i) ds[i] = d * static_cast<float>(sc[i]);
    for (int c = 0; c < 2; ++c) {  // 128 weights from 64 ql bytes and 32 qh bytes
      const uint8_t* l0 = ql + 64 * c;
      const uint8_t* h0 = qh + 32 * c;
      const float* s = ds + 8 * c;
      float* y = w + 128 * c;
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((l0[l] & 15) | (((h0[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((l0[l + 32] & 15) | (((h0[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4)) - 32;
        y[l] = s[is] * static_cast<float>(q1);
        y[l + 32] = s[is + 2] * static_cast<float>(q2);
        y[l + 64] = s[is + 4] * static_cast<float>(q3);
        y[l + 96] = s[is + 6] * static_cast<float>(q4);
      }
    }
  } else if constexpr (T == kIQ4_XS) {
    const float d = f16(b);
    for (int j = 0; j < 8; ++j) {
      const float dl = d * static_cast<float>(iq4xs_scale(j, b));
      const uint8_t* q = b + 8 + 16 * j;
      for (int l = 0; l < 16; ++l) {
        w[32 * j + l] = dl * static_cast<float>(kIq4Values[q[l] & 15]);
        w[32 * j + l + 16] = dl * static_cast<float>(kIq4Values[q[l] >> 4]);
      }
    }
  }
}

// A thread's weight rows n0 .. n1 - 1 in a few-row kernel (gguf_int8_gemv*.h), read as kStreams runs side by
// side: block g of row i of each run, then block g + 1, so kStreams rows far apart are in flight at once. One
// sequential read left a Xeon core (Sapphire Rapids class, 2-vCPU VM) at 7-10 GB/s whatever the software
// prefetch distance or hint (0-16 KB ahead, T0/T1/T2/NTA), against 12-16 GB/s for torch's sum over the same
// bytes; 4 runs read Llama-1B's shapes 1.5-1.8x faster (2 threads: 18-22 GB/s against 11-13; 2 runs 15-19,
// 8 runs no better than 4). K provides Acc (zero when built), add(acc, n, g) for block g of weight row n, and
// store(acc, n). The sums of each row are the same as one run's, in the same order.
constexpr int kStreams = 4;

template <class K>
[[gnu::always_inline]] inline void streamed_rows(const K& kernel, int64_t n0, int64_t n1, int64_t blocks) {
  const int64_t run = (n1 - n0) / kStreams;
  for (int64_t i = 0; i < run; ++i) {
    typename K::Acc acc[kStreams];
    for (int64_t g = 0; g < blocks; ++g)
      for (int s = 0; s < kStreams; ++s) kernel.add(acc[s], n0 + s * run + i, g);
    for (int s = 0; s < kStreams; ++s) kernel.store(acc[s], n0 + s * run + i);
  }
  for (int64_t n = n0 + kStreams * run; n < n1; ++n) {
    typename K::Acc acc;
    for (int64_t g = 0; g < blocks; ++g) kernel.add(acc, n, g);
    kernel.store(acc, n);
  }
}

}  // namespace pagedserve::gguf
