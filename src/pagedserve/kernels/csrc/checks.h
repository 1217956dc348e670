// Input checks shared by the public ops. Every op validates its arguments before it reads or writes
// through a raw pointer: a malformed call from Python must raise (a RuntimeError naming the op, the
// argument and the values), never read or write out of bounds. Checks cost O(dims) here; the
// per-element scans they need (offsets, block ids, positions) live in the ops and stay O(num_seqs),
// O(blocks used) or O(tokens), never O(tokens * heads).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace pagedserve {

enum class Layout {
  kAny,         // any strides
  kRows,        // innermost dimension contiguous (stride 1); outer strides free
  kContiguous,  // fully contiguous
};

// `dim` < 0: any number of dimensions.
inline void check_tensor(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype, int64_t dim,
                         Layout layout) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got device ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(dim < 0 || t.dim() == dim, op, ": ", name, " must have ", dim, " dimensions, got shape ", t.sizes());
  if (layout == Layout::kContiguous) {
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.strides());
  } else if (layout == Layout::kRows) {
    TORCH_CHECK(t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1, op, ": ", name,
                " must be contiguous in its last dimension, got strides ", t.strides());
  }
}

}  // namespace pagedserve
