// Small fused float32 CPU ops for the decoder layer. Each replaces 3-8 torch ops (and their temporaries):
// at decode batch sizes a layer is ~30 tiny ops, so dispatch overhead, not arithmetic, sets the latency.
//   rms_norm(x, w, eps)                       -> w * x / sqrt(mean(x^2) + eps)      (rows of x)
//   fused_add_rms_norm_(x, residual, w, eps)  residual += x; x = rms_norm(residual)  (both in place)
//   rotary_embedding_(q, k, positions, cos_sin) q, k rotated in place ("rotate half" / NeoX layout)
//   silu_and_mul(gate_up)                     -> silu(gate) * up                     (halves of the last dim)
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>

#include "checks.h"
#include "ops_library.h"

namespace {

using pagedserve::check_tensor;
using pagedserve::Layout;

void check_rows(const at::Tensor& t, const char* op, const char* name) {
  check_tensor(t, op, name, at::kFloat, 2, Layout::kRows);
}

// A norm weight: one float32 per hidden unit.
void check_norm_weight(const at::Tensor& weight, const char* op, int64_t hidden) {
  check_tensor(weight, op, "weight", at::kFloat, 1, Layout::kContiguous);
  TORCH_CHECK(weight.size(0) == hidden, op, ": weight has ", weight.size(0), " entries, the hidden size is ", hidden);
}

inline void norm_row(const float* __restrict src, const float* __restrict w, float* __restrict dst, int64_t n,
                     float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += src[i] * src[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = w[i] * (src[i] * inv);
}

// Rows per parallel chunk: below this a second thread costs more than it saves.
constexpr int64_t kRowGrain = 16;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm", "x");
  check_norm_weight(weight, "rms_norm", x.size(1));
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xp + r * xs, wp, op + r * n, n, static_cast<float>(eps));
  });
  return out;
}

void fused_add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  constexpr const char* op = "fused_add_rms_norm_";
  check_rows(x, op, "x");
  check_rows(residual, op, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), op, ": x ", x.sizes(), " and residual ", residual.sizes(),
              " must have the same shape");
  check_norm_weight(weight, op, x.size(1));
  const int64_t n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* xr = xp + r * xs;
      float* rr = rp + r * rs;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) rr[i] += xr[i];
      norm_row(rr, wp, xr, n, static_cast<float>(eps));
    }
  });
}

void rotate(float* __restrict x, const float* __restrict cs, int64_t half) {
  const float* c = cs;
  const float* s = cs + half;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c[i] - x2 * s[i];
    x[i + half] = x2 * c[i] + x1 * s[i];
  }
}

void rotary_embedding_(at::Tensor query, at::Tensor key, const at::Tensor& positions, const at::Tensor& cos_sin) {
  constexpr const char* op = "rotary_embedding_";
  check_tensor(query, op, "query", at::kFloat, 3, Layout::kRows);
  check_tensor(key, op, "key", at::kFloat, 3, Layout::kRows);
  check_tensor(positions, op, "positions", at::kLong, 1, Layout::kContiguous);
  check_tensor(cos_sin, op, "cos_sin", at::kFloat, 2, Layout::kContiguous);
  TORCH_CHECK(query.size(2) % 2 == 0, op, ": head_dim must be even (rotate half), got ", query.size(2));
  TORCH_CHECK(key.size(0) == query.size(0) && key.size(2) == query.size(2), op,
              ": key must be [num_tokens, num_kv_heads, head_dim] with query's tokens and head_dim, got query ",
              query.sizes(), " and key ", key.sizes());
  TORCH_CHECK(positions.size(0) == query.size(0), op, ": positions must have one entry per token (", query.size(0),
              "), got ", positions.size(0));
  TORCH_CHECK(cos_sin.size(1) == query.size(2), op, ": cos_sin must be [max_position, head_dim = ", query.size(2),
              "], got ", cos_sin.sizes());
  const int64_t head_dim = query.size(2), half = head_dim / 2, max_pos = cos_sin.size(0);
  const int64_t hq = query.size(1), hk = key.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  float* qp = query.data_ptr<float>();
  float* kp = key.data_ptr<float>();
  const float* table = cos_sin.data_ptr<float>();
  for (int64_t t = 0; t < query.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, op, ": positions[", t, "] = ", pos[t], " outside the rotary table's ",
                max_pos, " positions");
  at::parallel_for(0, query.size(0), kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* cs = table + pos[t] * head_dim;
      for (int64_t h = 0; h < hq; ++h) rotate(qp + t * query.stride(0) + h * query.stride(1), cs, half);
      for (int64_t h = 0; h < hk; ++h) rotate(kp + t * key.stride(0) + h * key.stride(1), cs, half);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul", "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up's last dimension must be even (gate | up), got ",
              gate_up.size(1));
  const int64_t n = gate_up.size(1) / 2, gs = gate_up.stride(0);
  at::Tensor out = at::empty({gate_up.size(0), n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, gate_up.size(0), kRowGrain / 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* g = gp + r * gs;
      const float* u = g + n;
      float* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace

PAGEDSERVE_LIBRARY_FRAGMENT(m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding_(Tensor(a!) query, Tensor(b!) key, Tensor positions, Tensor cos_sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, rms_norm);
  m.impl("fused_add_rms_norm_", c10::DispatchKey::CPU, fused_add_rms_norm_);
  m.impl("rotary_embedding_", c10::DispatchKey::CPU, rotary_embedding_);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, silu_and_mul);
}
