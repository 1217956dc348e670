// Small fused CPU ops for the decoder layer, on float32 or bf16 activations (bf16 is converted on load and
// rounded once on store; the arithmetic is float32). Each replaces 3-8 torch ops (and their temporaries):
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
#include <type_traits>

#include "checks.h"
#include "kv_types.h"
#include "ops_library.h"

namespace {

using pagedserve::bf16_t;
using pagedserve::check_tensor;
using pagedserve::from_float;
using pagedserve::Layout;
using pagedserve::to_float;

// An activation: float32 or bf16 (the op's other tensors then take its type, except tables noted below).
at::ScalarType check_activation(const at::Tensor& t, const char* op, const char* name, int64_t dim) {
  TORCH_CHECK(t.defined() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16), op, ": ", name,
              " must be Float or BFloat16, got ", t.defined() ? t.scalar_type() : at::ScalarType::Undefined);
  check_tensor(t, op, name, t.scalar_type(), dim, Layout::kRows);
  return t.scalar_type();
}

void check_rows(const at::Tensor& t, const char* op, const char* name) { check_activation(t, op, name, 2); }

// A norm weight: one value per hidden unit, of the activations' type.
void check_norm_weight(const at::Tensor& weight, const char* op, int64_t hidden, at::ScalarType dtype) {
  check_tensor(weight, op, "weight", dtype, 1, Layout::kContiguous);
  TORCH_CHECK(weight.size(0) == hidden, op, ": weight has ", weight.size(0), " entries, the hidden size is ", hidden);
}

// Runs fn with a null pointer of the element type of dtype (float or bf16_t) to pick the template.
template <typename Fn>
void dispatch_float(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kBFloat16) {
    fn(static_cast<bf16_t*>(nullptr));
  } else {
    fn(static_cast<float*>(nullptr));
  }
}

template <typename T>
inline void norm_row(const T* __restrict src, const T* __restrict w, T* __restrict dst, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += to_float(src[i]) * to_float(src[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(to_float(w[i]) * (to_float(src[i]) * inv));
}

// Rows per parallel chunk: below this a second thread costs more than it saves.
constexpr int64_t kRowGrain = 16;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm", "x");
  check_norm_weight(weight, "rms_norm", x.size(1), x.scalar_type());
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), xs = x.stride(0);
  dispatch_float(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* wp = static_cast<const T*>(weight.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) norm_row(xp + r * xs, wp, op + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

void fused_add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  constexpr const char* op = "fused_add_rms_norm_";
  check_rows(x, op, "x");
  check_tensor(residual, op, "residual", x.scalar_type(), 2, Layout::kRows);
  TORCH_CHECK(x.sizes() == residual.sizes(), op, ": x ", x.sizes(), " and residual ", residual.sizes(),
              " must have the same shape");
  check_norm_weight(weight, op, x.size(1), x.scalar_type());
  const int64_t n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  dispatch_float(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* xp = static_cast<T*>(x.data_ptr());
    T* rp = static_cast<T*>(residual.data_ptr());
    const T* wp = static_cast<const T*>(weight.data_ptr());
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        T* xr = xp + r * xs;
        T* rr = rp + r * rs;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) rr[i] = from_float<T>(to_float(rr[i]) + to_float(xr[i]));
        norm_row(rr, wp, xr, n, static_cast<float>(eps));
      }
    });
  });
}

template <typename T>
void rotate(T* __restrict x, const float* __restrict cs, int64_t half) {
  const float* c = cs;
  const float* s = cs + half;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    x[i] = from_float<T>(x1 * c[i] - x2 * s[i]);
    x[i + half] = from_float<T>(x2 * c[i] + x1 * s[i]);
  }
}

// cos_sin stays float32 for bf16 activations: the angles' precision, rounded once with the result.
void rotary_embedding_(at::Tensor query, at::Tensor key, const at::Tensor& positions, const at::Tensor& cos_sin) {
  constexpr const char* op = "rotary_embedding_";
  check_activation(query, op, "query", 3);
  check_tensor(key, op, "key", query.scalar_type(), 3, Layout::kRows);
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
  const float* table = cos_sin.data_ptr<float>();
  for (int64_t t = 0; t < query.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, op, ": positions[", t, "] = ", pos[t], " outside the rotary table's ",
                max_pos, " positions");
  dispatch_float(query.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* qp = static_cast<T*>(query.data_ptr());
    T* kp = static_cast<T*>(key.data_ptr());
    at::parallel_for(0, query.size(0), kRowGrain, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* cs = table + pos[t] * head_dim;
        for (int64_t h = 0; h < hq; ++h) rotate(qp + t * query.stride(0) + h * query.stride(1), cs, half);
        for (int64_t h = 0; h < hk; ++h) rotate(kp + t * key.stride(0) + h * key.stride(1), cs, half);
      }
    });
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul", "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up's last dimension must be even (gate | up), got ",
              gate_up.size(1));
  const int64_t n = gate_up.size(1) / 2, gs = gate_up.stride(0);
  at::Tensor out = at::empty({gate_up.size(0), n}, gate_up.options());
  dispatch_float(gate_up.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* gp = static_cast<const T*>(gate_up.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    at::parallel_for(0, gate_up.size(0), kRowGrain / 4, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T* g = gp + r * gs;
        const T* u = g + n;
        T* o = op + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          const float gi = to_float(g[i]);
          o[i] = from_float<T>(gi / (1.f + std::exp(-gi)) * to_float(u[i]));
        }
      }
    });
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
