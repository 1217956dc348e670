// What every AMX kernel needs before its first tile instruction. Only the `amx` variant (kernels/isa.py)
// compiles with the tile and bf16 flags; PAGEDSERVE_AMX marks code that may use them.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDSERVE_AMX 1

#include <c10/util/Exception.h>
#include <cstdint>
#include <sys/syscall.h>
#include <unistd.h>

namespace pagedserve {

// Linux hands out the 8 KB tile state only on request, once per process; a tile instruction without it
// raises SIGILL. A function-local static runs the request exactly once, thread-safely.
inline void require_tile_state(const char* op) {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  TORCH_CHECK(granted, op, ": the kernel refused this process the AMX tile state (arch_prctl "
              "ARCH_REQ_XCOMP_PERM); run with PAGEDSERVE_CPU_ISA=avx512 to use the kernels without AMX");
}

// ldtilecfg's memory layout (palette 1) with tiles 0-7 at their largest, 16 rows x 64 bytes; a kernel that
// needs narrower tiles derives from it and shrinks those.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  }
};

}  // namespace pagedserve

#endif
