// A 16 x 16 float32 transpose in AVX-512 registers (unpack, then 128-bit lane shuffles): attention's key slabs and
// score tiles, the AMX GEMM's output tiles.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagedserve {

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

}  // namespace pagedserve

#endif
