// Finds the exact GGUF Q4_1 / Q8_0 blocks behind float32 weights (see pagedserve/model/layers/quant.py).
// Every weight is rebuilt and compared bit for bit; any block that does not reproduce makes the whole
// tensor fail (empty outputs), and the layer keeps its fp32 path.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "checks.h"
#include "ops_library.h"

namespace {

constexpr int64_t kBlock = 32;

inline float to_half(float x) { return static_cast<float>(c10::Half(x)); }

// q for weight w under scale d (and offset m): the rounded quotient, or a neighbour when the division
// rounded across a half (the rebuilt value decides). Returns false when no q in range rebuilds w.
template <int QMin, int QMax>
inline bool solve(float w, float d, float m, int& q) {
  const float guess = std::nearbyint((w - m) / d);
  for (float c : {guess, guess - 1.f, guess + 1.f}) {
    if (c < QMin || c > QMax) continue;
    if (d * c + m == w) {  // d * c is exact in float32 (an fp16 times a small integer)
      q = static_cast<int>(c);
      return true;
    }
  }
  return false;
}

std::tuple<at::Tensor, at::Tensor> find_blocks(const at::Tensor& w, bool q4) {
  pagedserve::check_tensor(w, q4 ? "find_q4_1" : "find_q8_0", "weight", at::kFloat, 2,
                           pagedserve::Layout::kContiguous);
  const int64_t n = w.size(0), k = w.size(1);
  auto fail = [&] {
    return std::make_tuple(at::empty({0}, w.options().dtype(at::kByte)), at::empty({0}, w.options()));
  };
  if (k % kBlock != 0 || n == 0) return fail();
  const int64_t nb = n * (k / kBlock);
  at::Tensor qs = at::empty({n, q4 ? k / 2 : k}, w.options().dtype(q4 ? at::kByte : at::kChar));
  at::Tensor scales = q4 ? at::empty({n, k / kBlock, 2}, w.options()) : at::empty({n, k / kBlock}, w.options());
  const float* wp = w.data_ptr<float>();
  uint8_t* qp = static_cast<uint8_t*>(qs.data_ptr());
  float* sp = scales.data_ptr<float>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, nb, 1024, [&](int64_t b0, int64_t b1) {
    int q[kBlock];
    for (int64_t b = b0; b < b1 && ok.load(std::memory_order_relaxed); ++b) {
      const float* x = wp + b * kBlock;
      float lo = x[0], hi = x[0], amax = std::fabs(x[0]);
      for (int64_t j = 1; j < kBlock; ++j) {
        lo = std::min(lo, x[j]);
        hi = std::max(hi, x[j]);
        amax = std::max(amax, std::fabs(x[j]));
      }
      float d = 0.f, m = q4 ? lo : 0.f;
      bool found = q4 ? to_half(lo) == lo && hi == lo : amax == 0.f;  // constant block: d = 0, q = 0
      if (found) {
        for (int& v : q) v = 0;
      } else if (!q4 || to_half(lo) == lo) {
        // The largest weight is almost always the top code (15, or 127); try a few lower tops too.
        const int top = q4 ? 15 : 127, lowest = q4 ? 1 : 100;
        for (int t = top; t >= lowest && !found; --t) {
          d = to_half((q4 ? hi - lo : amax) / static_cast<float>(t));
          if (d == 0.f) continue;
          found = true;
          for (int64_t j = 0; j < kBlock && found; ++j)
            found = q4 ? solve<0, 15>(x[j], d, m, q[j]) : solve<-127, 127>(x[j], d, 0.f, q[j]);
        }
      }
      if (!found) {
        ok.store(false, std::memory_order_relaxed);
        break;
      }
      if (q4) {
        for (int64_t j = 0; j < 16; ++j) qp[b * 16 + j] = static_cast<uint8_t>(q[j] | (q[j + 16] << 4));
        sp[2 * b] = d;
        sp[2 * b + 1] = m;
      } else {
        for (int64_t j = 0; j < kBlock; ++j) qp[b * kBlock + j] = static_cast<uint8_t>(static_cast<int8_t>(q[j]));
        sp[b] = d;
      }
    }
  });
  if (!ok.load()) return fail();
  return std::make_tuple(qs, scales);
}

std::tuple<at::Tensor, at::Tensor> find_q4_1(const at::Tensor& w) { return find_blocks(w, true); }
std::tuple<at::Tensor, at::Tensor> find_q8_0(const at::Tensor& w) { return find_blocks(w, false); }

}  // namespace

PAGEDSERVE_LIBRARY_FRAGMENT(m) {
  m.def("find_q4_1(Tensor weight) -> (Tensor, Tensor)");
  m.def("find_q8_0(Tensor weight) -> (Tensor, Tensor)");
  m.impl("find_q4_1", c10::DispatchKey::CPU, find_q4_1);
  m.impl("find_q8_0", c10::DispatchKey::CPU, find_q8_0);
}
