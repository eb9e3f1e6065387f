// What every AMX kernel here needs before its first tile instruction (gguf_dequant.cpp's bf16
// tiles, gguf_amx8.cpp's int8 tiles): the process's permission to use the tile registers, and the
// 64-byte configuration each thread loads with its tiles' shapes.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

// Linux gives a process the AMX register state only once it has asked for it.
inline bool permitted() {
    static const bool ok = [] {
        constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return ok;
}

// ldtilecfg's operand: palette 1, then per tile its bytes per row and its rows.
struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

}  // namespace amx
