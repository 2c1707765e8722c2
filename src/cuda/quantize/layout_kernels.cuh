// Layout converter kernels: e4m3 payloads token-major (T, H, 128) <-> token-contiguous (H, 128, P),
// and scale tensors plain <-> blocked128x4 for each orientation. Same tile walk as the quantizer
// (token_tile.cuh); padding bytes of the destination are written as 0 in the same pass. The
// token-contiguous side moves 32-byte pieces per column and tile (the quantizer's 128-byte strips
// would be faster; converters are not a hot path). Launched from layout_kernels.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/quantize/token_tile.cuh"
#include "mxflash/jagged.h"

namespace mxflash::cuda {

// ---------------------------------------------------------------- payloads
// 128 threads per tile, each 4 rows x 8 bytes of the token-major side.

struct PayloadParams {
  const uint8_t* src;
  uint8_t* dst;
  JaggedDevice jd;
  int64_t num_groups;
};

__global__ void __launch_bounds__(kTileThreads) to_token_contiguous_kernel(const PayloadParams p) {
  __shared__ alignas(16) uint32_t s_tile[kTileSmemWords];
  const int tid = int(threadIdx.x);
  const int quad = tid / kByteTileChunksPerRow, col0 = tid % kByteTileChunksPerRow * kByteTileCols,
            row0 = quad * kByteTileRows;
  const int64_t H = p.jd.H, P = p.jd.P;
  const int64_t row_elems = H * kHeadDim;
  const TileHalves halves(P);
  SequenceCursor sequence(p.jd);
  for (TileWalker tw(blockIdx.x, gridDim.x, p.num_groups, H); tw.valid(); tw.next()) {
    const int64_t g = tw.g, h = tw.h;
    const GroupSpan span = sequence.span(g);
    const int64_t off0 = int64_t(span.t_first + row0) * row_elems + h * kHeadDim + col0;
    uint32_t q[kByteTileRows][2] = {};  // padding tokens stay 0
#pragma unroll
    for (int i = 0; i < kByteTileRows; ++i) {
      if (row0 + i < span.n_valid) {
        const uint2 t = __ldg(reinterpret_cast<const uint2*>(p.src + off0 + i * row_elems));
        q[i][0] = t.x, q[i][1] = t.y;
      }
    }
    __syncthreads();  // the previous tile's readers are done with s_tile
#pragma unroll
    for (int cw = 0; cw < 2; ++cw) {
      uint32_t a[4] = {q[0][cw], q[1][cw], q[2][cw], q[3][cw]};
      transpose4x4_bytes(a);
#pragma unroll
      for (int j = 0; j < 4; ++j) s_tile[tile_word_index(col0 + 4 * cw + j, quad)] = a[j];
    }
    __syncthreads();
    tile_store_contiguous(s_tile, halves, p.dst + contiguous_tile_offset(h, g, P));
  }
}

__global__ void __launch_bounds__(kTileThreads) to_token_major_kernel(const PayloadParams p) {
  __shared__ alignas(16) uint32_t s_tile[kTileSmemWords];
  const int tid = int(threadIdx.x);
  const int quad = tid / kByteTileChunksPerRow, col0 = tid % kByteTileChunksPerRow * kByteTileCols,
            row0 = quad * kByteTileRows;
  const int64_t H = p.jd.H, P = p.jd.P;
  const int64_t row_elems = H * kHeadDim;
  const TileHalves halves(P);
  SequenceCursor sequence(p.jd);
  for (TileWalker tw(blockIdx.x, gridDim.x, p.num_groups, H); tw.valid(); tw.next()) {
    const int64_t g = tw.g, h = tw.h;
    const GroupSpan span = sequence.span(g);
    const int64_t off0 = int64_t(span.t_first + row0) * row_elems + h * kHeadDim + col0;
    if (span.n_valid == 0) continue;  // same for the whole CTA: no barrier is skipped by part of it
    __syncthreads();
    tile_load_contiguous(s_tile, halves, p.src + contiguous_tile_offset(h, g, P));
    __syncthreads();
    uint32_t q[kByteTileRows][2];
#pragma unroll
    for (int cw = 0; cw < 2; ++cw) {
      uint32_t a[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) a[j] = s_tile[tile_word_index(col0 + 4 * cw + j, quad)];
      transpose4x4_bytes(a);
#pragma unroll
      for (int i = 0; i < kByteTileRows; ++i) q[i][cw] = a[i];
    }
#pragma unroll
    for (int i = 0; i < kByteTileRows; ++i)
      if (row0 + i < span.n_valid)
        *reinterpret_cast<uint2*>(p.dst + off0 + i * row_elems) = make_uint2(q[i][0], q[i][1]);
  }
}

// ---------------------------------------------------------------- scales
// One warp per tile (g, h); lane r is token row 32g + r. Scale data is 1/32 of the payload, so
// simple word/byte moves suffice.
struct ScaleParams {
  const uint8_t* src;
  uint8_t* dst;
  JaggedDevice jd;
  int64_t num_groups;
};

// kToBlocked: plain -> blocked (padding rows/groups of the blocked tensor get 0); else blocked ->
// plain (padding groups of the seq/square32 plain tensors get 0; hdim plain has no padding).
template <Orientation kO, bool kToBlocked>
__global__ void __launch_bounds__(kTileThreads) scale_layout_kernel(const ScaleParams p) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps_per_cta = kTileThreads / 32;
  const int64_t first = int64_t(blockIdx.x) * warps_per_cta + (threadIdx.x >> 5);
  const int64_t H = p.jd.H, P = p.jd.P;
  SequenceCursor sequence(p.jd);
  for (TileWalker tw(first, int64_t(gridDim.x) * warps_per_cta, p.num_groups, H); tw.valid(); tw.next()) {
    const int64_t g = tw.g, h = tw.h;
    const GroupSpan span = sequence.span(g);
    const int64_t atom = blocked_atom_base(h, g, P);
    const int group_col = int(g % kGroupsPerAtom);
    const bool real_row = lane < span.n_valid;
    const bool real_group = span.n_valid > 0;
    // Blocked word of token row `lane` (hdim and square32 share the hdim blocked layout).
    const int64_t blocked_row = atom + 16 * lane + 4 * group_col;
    if constexpr (kO == Orientation::kHdim) {
      const int64_t plain = hdim_plain_offset(span.t_first + lane, h, 0, H);
      if constexpr (kToBlocked) {
        *reinterpret_cast<uint32_t*>(p.dst + blocked_row) =
            real_row ? *reinterpret_cast<const uint32_t*>(p.src + plain) : 0u;
      } else if (real_row) {
        *reinterpret_cast<uint32_t*>(p.dst + plain) = *reinterpret_cast<const uint32_t*>(p.src + blocked_row);
      }
    } else if constexpr (kO == Orientation::kSquare32) {
      const int64_t plain = square_plain_offset(g, h, 0, H);
      if constexpr (kToBlocked) {
        *reinterpret_cast<uint32_t*>(p.dst + blocked_row) =
            real_row ? *reinterpret_cast<const uint32_t*>(p.src + plain) : 0u;
      } else if (lane == 0) {
        // The group's first token row carries the block scales.
        *reinterpret_cast<uint32_t*>(p.dst + plain) =
            real_group ? *reinterpret_cast<const uint32_t*>(p.src + blocked_row) : 0u;
      }
    } else {
      // seq: lane r moves columns d = r + 32 m, m = 0..3 (4 bytes at stride 4 in the atom row r).
#pragma unroll
      for (int m = 0; m < kHeadDim / 32; ++m) {
        const int d = lane + 32 * m;
        const int64_t plain = seq_plain_offset(g, h, d, H);
        const int64_t blocked = atom + 16 * lane + 4 * m + group_col;
        if constexpr (kToBlocked)
          p.dst[blocked] = real_group ? p.src[plain] : uint8_t(0);
        else
          p.dst[plain] = real_group ? p.src[blocked] : uint8_t(0);
      }
    }
  }
}

}  // namespace mxflash::cuda
