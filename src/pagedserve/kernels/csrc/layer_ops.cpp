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
#include <torch/library.h>

#include <cmath>

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1, name,
              " must be a 2-D float32 CPU tensor with contiguous rows");
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
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must match the hidden size");
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
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && weight.is_contiguous() && weight.numel() == x.size(1),
              "x, residual and weight must agree");
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
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.stride(2) == 1 && key.stride(2) == 1 &&
                  query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat && query.device().is_cpu(),
              "query/key must be float32 CPU [tokens, heads, head_dim] with contiguous head_dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == query.size(0),
              "positions must be contiguous int64, one per token");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.scalar_type() == at::kFloat && cos_sin.size(1) == query.size(2),
              "cos_sin must be a contiguous float32 [max_position, head_dim] table");
  const int64_t head_dim = query.size(2), half = head_dim / 2, max_pos = cos_sin.size(0);
  const int64_t hq = query.size(1), hk = key.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  float* qp = query.data_ptr<float>();
  float* kp = key.data_ptr<float>();
  const float* table = cos_sin.data_ptr<float>();
  for (int64_t t = 0; t < query.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rotary table");
  at::parallel_for(0, query.size(0), kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* cs = table + pos[t] * head_dim;
      for (int64_t h = 0; h < hq; ++h) rotate(qp + t * query.stride(0) + h * query.stride(1), cs, half);
      for (int64_t h = 0; h < hk; ++h) rotate(kp + t * key.stride(0) + h * key.stride(1), cs, half);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
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

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding_(Tensor(a!) query, Tensor(b!) key, Tensor positions, Tensor cos_sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, rms_norm);
  m.impl("fused_add_rms_norm_", c10::DispatchKey::CPU, fused_add_rms_norm_);
  m.impl("rotary_embedding_", c10::DispatchKey::CPU, rotary_embedding_);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, silu_and_mul);
}
