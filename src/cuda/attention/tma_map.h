// Internal (CUDA sources only): TMA tensor maps of the attention kernels' private layouts.
#pragma once
#include <cuda.h>

#include <cstdint>

#include "mxflash/status.h"

namespace mxflash::cuda {

// A 2-D uint8 tensor map over `rows` rows of `inner` bytes at `base`, loading 128 x 128 tiles with
// the 128-byte swizzle the wgmma descriptors expect (sm90::make_desc_k128b).
Status make_tile_map(CUtensorMap* map, void* base, uint64_t inner, uint64_t rows, uint32_t box_rows = 128);

// A 3-D bf16 tensor map over (rows, heads, 128) at `base` (at least one row), in boxes of 64 channels
// x 1 head x 64 rows with the 128-byte swizzle: the staged epilogues' stores
// (attn::stage_and_store).
Status make_bf16_rows_map(CUtensorMap* map, void* base, uint64_t rows, uint64_t heads);

}  // namespace mxflash::cuda
