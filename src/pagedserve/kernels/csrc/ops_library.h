// The op namespace a build registers into: torch.ops.<PAGEDSERVE_OPS_NS>. pagedserve/kernels builds every
// ISA variant into its own namespace (pagedserve_avx512, pagedserve_avx2, ...), so variants can be loaded
// side by side in one process (the tests compare each against torch).
#pragma once

#include <torch/library.h>

#include <string>

#ifndef PAGEDSERVE_OPS_NS
#define PAGEDSERVE_OPS_NS pagedserve
#endif

// TORCH_LIBRARY pastes its namespace argument into identifiers, which would not expand a macro: one more
// level of expansion first.
#define PAGEDSERVE_LIBRARY_EXPAND(ns, m) TORCH_LIBRARY(ns, m)
#define PAGEDSERVE_LIBRARY(m) PAGEDSERVE_LIBRARY_EXPAND(PAGEDSERVE_OPS_NS, m)
#define PAGEDSERVE_LIBRARY_FRAGMENT_EXPAND(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define PAGEDSERVE_LIBRARY_FRAGMENT(m) PAGEDSERVE_LIBRARY_FRAGMENT_EXPAND(PAGEDSERVE_OPS_NS, m)

namespace pagedserve {

// What the compiler targeted for this build; the loader checks it against the variant it asked for, so
// flags that never reached the compiler (or a stale library) fail loudly instead of running other code.
inline std::string compiled_isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return "amx";
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return "avx2";
#else
  return "baseline";
#endif
}

}  // namespace pagedserve
