// Dequantization kernel: out (T, H, 128) fp32 or bf16 = e4m3(payload) * scale of its block, for
// every orientation, scale layout and payload layout. Same tile walk as the quantizer
// (token_tile.cuh): 128 threads per 32-token x 128-column tile, each thread 4 rows x 8 columns
// (8 payload bytes per row); a token-contiguous payload is transposed back through shared memory,
// read in 32-byte pieces per column (the quantizer's 128-byte strips would be faster; this is not
// a hot path). Launched from dequantize_kernels.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/quantize/mx_device.cuh"
#include "cuda/quantize/token_tile.cuh"
#include "mxflash/jagged.h"

namespace mxflash::cuda {

struct DequantizeParams {
  const uint8_t* payload;
  const uint8_t* scales;
  void* out;
  JaggedDevice jd;
  int64_t num_groups;
  bool blocked;
};

template <bool kOutBf16, Orientation kO, bool kContiguous>
__global__ void __launch_bounds__(kTileThreads) dequantize_kernel(const DequantizeParams p) {
  __shared__ alignas(16) uint32_t s_tile[kTileSmemWords];
  const int tid = int(threadIdx.x);
  const int chunk = tid % kByteTileChunksPerRow, quad = tid / kByteTileChunksPerRow;
  const int row0 = quad * kByteTileRows, col0 = chunk * kByteTileCols;
  const int hdim_block = col0 / kBlockSize;
  const int64_t H = p.jd.H, P = p.jd.P;
  const int64_t row_elems = H * kHeadDim;
  const TileHalves halves(P);
  SequenceCursor sequence(p.jd);

  for (TileWalker tw(blockIdx.x, gridDim.x, p.num_groups, H); tw.valid(); tw.next()) {
    const int64_t g = tw.g, h = tw.h;
    const GroupSpan span = sequence.span(g);
    if (span.n_valid == 0) continue;  // same for the whole CTA: no barrier is skipped by part of it
    const int64_t atom = blocked_atom_base(h, g, P);
    const int group_col = int(g % kGroupsPerAtom);
    // Element offset of this thread's first row in token-major tensors (payload and out).
    const int64_t off0 = int64_t(span.t_first + row0) * row_elems + h * kHeadDim + col0;

    // Payload bytes: q[i][0] columns col0..col0+3 of row row0+i, q[i][1] the next 4.
    uint32_t q[kByteTileRows][2] = {};
    if constexpr (kContiguous) {
      __syncthreads();  // the previous tile's readers are done with s_tile
      tile_load_contiguous(s_tile, halves, p.payload + contiguous_tile_offset(h, g, P));
      __syncthreads();
#pragma unroll
      for (int cw = 0; cw < 2; ++cw) {
        uint32_t a[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) a[j] = s_tile[tile_word_index(col0 + 4 * cw + j, quad)];
        transpose4x4_bytes(a);
#pragma unroll
        for (int i = 0; i < kByteTileRows; ++i) q[i][cw] = a[i];
      }
    } else {
#pragma unroll
      for (int i = 0; i < kByteTileRows; ++i) {
        if (row0 + i < span.n_valid) {
          const uint2 t = __ldg(reinterpret_cast<const uint2*>(p.payload + off0 + i * row_elems));
          q[i][0] = t.x, q[i][1] = t.y;
        }
      }
    }

    // Scale bytes of this thread's columns (seq) or its one block (square32, plain layout).
    uint32_t col_scale[kByteTileCols] = {};
    if constexpr (kO == Orientation::kSeq) {
#pragma unroll
      for (int e = 0; e < kByteTileCols; ++e) {
        const int d = col0 + e;
        col_scale[e] =
            p.scales[p.blocked ? atom + 16 * (d % 32) + 4 * (d / 32) + group_col : seq_plain_offset(g, h, d, H)];
      }
    }
    const uint32_t square_plain_scale =
        (kO == Orientation::kSquare32 && !p.blocked) ? p.scales[square_plain_offset(g, h, hdim_block, H)] : 0u;

#pragma unroll
    for (int i = 0; i < kByteTileRows; ++i) {
      const int r = row0 + i;
      if (r >= span.n_valid) continue;
      const int64_t o = off0 + i * row_elems;
      // hdim, and square32 in the blocked layout, keep one scale byte per token row (plain hdim:
      // one byte per 32 elements, at element offset / 32).
      uint32_t row_scale = square_plain_scale;
      if (kO == Orientation::kHdim || (kO == Orientation::kSquare32 && p.blocked))
        row_scale =
            p.scales[p.blocked ? atom + 16 * r + 4 * group_col + hdim_block : int64_t(uint64_t(o) / kBlockSize)];
      float v[kByteTileCols];
#pragma unroll
      for (int e = 0; e < kByteTileCols; ++e)
        v[e] = dequantize_value((q[i][e / 4] >> (8 * (e % 4))) & 0xFFu,
                                kO == Orientation::kSeq ? col_scale[e] : row_scale);
      if constexpr (kOutBf16) {
        uint32_t w[kByteTileCols / 2];
#pragma unroll
        for (int k = 0; k < kByteTileCols / 2; ++k)
          w[k] = uint32_t(float_to_bf16(v[2 * k])) | (uint32_t(float_to_bf16(v[2 * k + 1])) << 16);
        *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.out) + o) = make_uint4(w[0], w[1], w[2], w[3]);
      } else {
        float4* dst = reinterpret_cast<float4*>(static_cast<float*>(p.out) + o);
        dst[0] = make_float4(v[0], v[1], v[2], v[3]);
        dst[1] = make_float4(v[4], v[5], v[6], v[7]);
      }
    }
  }
}

}  // namespace mxflash::cuda
