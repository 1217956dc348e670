// Element types the kernels read and write besides float32, converted to float32 for the arithmetic:
//   bf16_t      bfloat16 activations and caches: the top 16 bits of a float32
//   int8_t      an 8-bit KV cache row: head_dim codes, then the row's float32 scale (value = code * scale)
//   fp8_e4m3_t  the same with e4m3 codes (1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no inf)
// The 8-bit row layout is pagedserve/attention/kv_quant.py's: the scale's 4 bytes follow the codes, so a row
// is head_dim + 4 bytes and the scale may sit at any byte offset (read with memcpy). Conversions are written
// without branches so that loops over a row vectorize on every ISA variant.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedserve {

using bf16_t = uint16_t;
struct fp8_e4m3_t {
  uint8_t bits;
};

constexpr int64_t kScaleBytes = 4;

template <typename T>
constexpr bool is_8bit_v = std::is_same_v<T, int8_t> || std::is_same_v<T, fp8_e4m3_t>;

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bf16_to_float(bf16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

// Round to nearest even, as torch's .to(torch.bfloat16) does for finite values.
inline bf16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  return static_cast<bf16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// e4m3 -> float32. A normal code's exponent and mantissa bits, moved to float32's positions, need the
// exponent bias moved from 7 to 127 (+120 << 23); a subnormal code (exponent 0) is mantissa * 2^-9, computed
// in floats so that no float32 subnormal appears (denormals-are-zero would flush it).
inline float fp8_e4m3_to_float(uint8_t code) {
  const uint32_t em = code & 0x7Fu;
  const float normal = bits_to_float((em << 20) + (120u << 23));
  const float subnormal = static_cast<float>(em) * 0x1p-9f;
  const float mag = em >= 8 ? normal : subnormal;
  return bits_to_float(float_to_bits(mag) | (static_cast<uint32_t>(code & 0x80u) << 24));
}

// float32 (already scaled into [-448, 448]) -> e4m3, round to nearest even; larger magnitudes saturate to
// 448 (0x7E) instead of reaching the NaN code 0x7F.
inline uint8_t float_to_fp8_e4m3(float f) {
  uint32_t u = float_to_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  u &= 0x7FFFFFFFu;
  const float a = bits_to_float(u);
  uint32_t code;
  if (a < 0x1p-6f) {  // below the smallest normal: steps of 2^-9 (rounding up to 8 gives that normal)
    code = static_cast<uint32_t>(std::nearbyint(a * 0x1p9f));
  } else {  // keep 3 mantissa bits, rounding the 20 dropped ones to even; a carry moves into the exponent
    u += 0x7FFFFu + ((u >> 20) & 1u);
    code = std::min((u >> 20) - (120u << 3), 0x7Eu);
  }
  return static_cast<uint8_t>(sign | code);
}

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) { return bf16_to_float(x); }

template <typename T>
inline T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    static_assert(std::is_same_v<T, bf16_t>);
    return float_to_bf16(x);
  }
}

// Bytes of one cache row (one token's key or value for one kv head) of type CT.
template <typename CT>
constexpr int64_t row_bytes(int64_t head_dim) {
  if constexpr (is_8bit_v<CT>) {
    return head_dim + kScaleBytes;
  } else {
    return head_dim * static_cast<int64_t>(sizeof(CT));
  }
}

#if defined(__AVX2__) && defined(__F16C__)
// 8 elements of a cache row -> 8 float32s. An e4m3 code moved into a float16's bit positions (sign to bit
// 15, exponent and mantissa shifted left by 7) is the same number times 2^-8 with the exponent bias 15
// instead of 7, subnormals included, and F16C converts it exactly; kScaleFp8 folds the 2^8 back in.
template <typename CT>
inline __m256 load8(const uint8_t* p, __m256 scale) {
  if constexpr (std::is_same_v<CT, bf16_t>) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  } else if constexpr (std::is_same_v<CT, int8_t>) {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), scale);
  } else {
    const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x7F)), 7));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), scale);
  }
}
#endif

// The scale of a cache row of n elements: its stored float32 for 8-bit rows, 1 otherwise.
template <typename CT>
inline float row_scale(const uint8_t* row, int64_t n) {
  float scale = 1.f;
  if constexpr (is_8bit_v<CT>) std::memcpy(&scale, row + n, sizeof scale);
  return scale;
}

// What turns a row's codes as the SIMD loads convert them (load8 with scale 1, the AVX-512 load16) into its
// values: the row's scale, times 2^8 for e4m3 codes (converted through float16).
template <typename CT>
inline float simd_scale(const uint8_t* row, int64_t n) {
  return std::is_same_v<CT, fp8_e4m3_t> ? row_scale<CT>(row, n) * 256.f : row_scale<CT>(row, n);
}

// One cache row of type CT -> n float32s.
template <typename CT>
inline void load_row(const uint8_t* __restrict row, int64_t n, float* __restrict dst) {
  if constexpr (std::is_same_v<CT, float>) {
    std::memcpy(dst, row, n * sizeof(float));
    return;
  }
  const float scale = row_scale<CT>(row, n);
  int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
  const __m256 vscale = _mm256_set1_ps(simd_scale<CT>(row, n));
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(dst + d, load8<CT>(row + d * sizeof(CT), vscale));
#endif
  for (; d < n; ++d) {  // the baseline variant, and the tail
    if constexpr (std::is_same_v<CT, bf16_t>) {
      dst[d] = bf16_to_float(reinterpret_cast<const bf16_t*>(row)[d]);
    } else if constexpr (std::is_same_v<CT, int8_t>) {
      dst[d] = static_cast<float>(static_cast<int8_t>(row[d])) * scale;
    } else {
      dst[d] = fp8_e4m3_to_float(row[d]) * scale;
    }
  }
}

// n values of type IT (float or bf16) -> one cache row of type CT. 8-bit rows scale by the row's absolute
// maximum, as kv_quant.quantize does: int8 to +-127, fp8 to e4m3's largest normal, 448.
template <typename IT, typename CT>
inline void store_row(const IT* __restrict src, int64_t n, uint8_t* __restrict row) {
  if constexpr (std::is_same_v<IT, CT>) {
    std::memcpy(row, src, n * sizeof(IT));
  } else if constexpr (!is_8bit_v<CT>) {
    CT* dst = reinterpret_cast<CT*>(row);
    for (int64_t d = 0; d < n; ++d) dst[d] = from_float<CT>(to_float(src[d]));
  } else {
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(to_float(src[d])));
    constexpr float qmax = std::is_same_v<CT, int8_t> ? 127.f : 448.f;
    const float scale = std::max(amax, 1e-12f) / qmax;
    for (int64_t d = 0; d < n; ++d) {
      const float q = to_float(src[d]) / scale;
      if constexpr (std::is_same_v<CT, int8_t>) {
        row[d] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(q), -127.f, 127.f)));
      } else {
        row[d] = float_to_fp8_e4m3(q);
      }
    }
    std::memcpy(row + n, &scale, sizeof scale);
  }
}

}  // namespace pagedserve
