// What the AMX paths of the CPU kernels share: the tile configuration's layout and the request for the
// tile registers.
#pragma once

#include <cstdint>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace freight {

// The 64-byte operand of ldtilecfg (palette 1). Kernels keep theirs as a constant in memory: GCC 12 drops
// stores into a local config before _tile_loadconfig as dead (it does not see the instruction read them),
// leaving tiles of zero size.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Whether the kernel lets this process use the tile registers: Linux asks each process to request them
// once (oneDNN makes the same request; asking again is harmless). The caller checks the CPU's features.
inline bool request_amx_tiles() {
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace freight
