// The quantization kernel: one read of x (T, H, 128) produces the hdim output, the seq or square32
// output, or both. Launched from quantize_launch.cuh, instantiated per input type in
// quantize_bf16.cu and quantize_fp32.cu.
//
// Work: grid-stride over tiles of 32 padded tokens x 128 columns of one head (token_tile.cuh),
// 128 threads per tile. Each thread loads kRows 16-byte chunks of one chunk column (all loads in
// flight before any use), so a warp reads whole 256/512-byte rows: fully coalesced.
//  hdim:     block = the kLanesPerBlock lanes covering 32 columns of a row: butterfly max; lane j
//            of the block computes row j's scale and shares 1/scale. No barrier.
//  seq:      block = one column over the tile's 32 tokens: per-thread max over its rows, shuffle
//            (bf16: the two half-warps share a chunk column), then the 4 warps through shared
//            memory; thread d computes column d's scale and publishes 1/scale.
//  square32: the seq column maxima reduced over the 32 columns of warp d/32.
//  token-contiguous payloads go through a transposed shared tile and leave as 32-byte sectors.
// Rows past the sequence end are zeros (the reference's zero padding): they give zero bytes in a
// token-contiguous payload and scale 0 in a padding group, which is what those bytes must hold.
// Elements use the hardware e4m3 conversion; blocks with scale 0xFF (holding inf/NaN) get their
// non-finite elements patched afterwards (mx_device.cuh has the proof obligations).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/quantize/mx_device.cuh"
#include "cuda/quantize/token_tile.cuh"
#include "mxflash/jagged.h"

namespace mxflash::cuda {

enum class TokOut { kNone, kSeq, kSquare32 };

// Thread layout over a tile for input element type In (uint16_t = bf16 bits, or float).
template <typename In>
struct QuantTileMap {
  static constexpr int kElems = 16 / int(sizeof(In));                       // 8 bf16 / 4 fp32 per load
  static constexpr int kChunksPerRow = kHeadDim / kElems;                   // 16 / 32
  static constexpr int kRows = kTileTokens * kChunksPerRow / kTileThreads;  // 4 / 8 rows per thread
  static constexpr int kLanesPerBlock = kBlockSize / kElems;                // 4 / 8 lanes per hdim block
  static constexpr int kOutWords = kElems / 4;                              // e4m3 words per chunk: 2 / 1
  static_assert(kRows * kElems == kBlockSize, "a thread holds 32 values per tile");
  static_assert(kRows % 4 == 0 && kElems % 4 == 0, "the token-contiguous transpose works on 4x4 byte squares");
  static_assert(32 % kChunksPerRow == 0, "a warp load instruction covers whole rows");
  static_assert(kLanesPerBlock == kRows, "hdim: lane j of a block computes the scale of row j");
};

struct QuantizeParams {
  const void* x;
  JaggedDevice jd;
  int64_t num_groups;  // P / 32
  ScalingMode mode;
  bool blocked;  // scale layout
  uint8_t* hdim_payload;
  uint8_t* hdim_scales;
  uint8_t* tok_payload;
  uint8_t* tok_scales;
};

// Element e of a 16-byte chunk as fp32 (bf16 widens exactly by a shift).
template <typename In>
__device__ __forceinline__ float chunk_element(const uint4& v, int e) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  if constexpr (sizeof(In) == 2)
    return __uint_as_float((e & 1) ? (w[e >> 1] & 0xFFFF0000u) : (w[e >> 1] << 16));
  else
    return __uint_as_float(w[e]);
}

// Max of |x| over a chunk, as fp32 bits. An integer max of |x| bits orders non-negative floats
// like a float max and ranks every NaN above inf, so NaN propagates (fmaxf would drop it).
template <typename In>
__device__ __forceinline__ uint32_t chunk_amax_bits(const uint4& v) {
  if constexpr (sizeof(In) == 2) {
    const uint32_t m = __vmaxu2(__vmaxu2(v.x & kBf16AbsMask2, v.y & kBf16AbsMask2),
                                __vmaxu2(v.z & kBf16AbsMask2, v.w & kBf16AbsMask2));
    return max(m << 16, m & 0xFFFF0000u);
  } else {
    return max(max(v.x & kAbsMask, v.y & kAbsMask), max(v.z & kAbsMask, v.w & kAbsMask));
  }
}

// Per-word max of |x| over a thread's rows: bf16 words keep two 16-bit column maxima, fp32 words one.
template <typename In, int kRows>
__device__ __forceinline__ void column_amax(const uint4 (&v)[kRows], uint32_t (&m)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) m[k] = 0;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const uint32_t w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (sizeof(In) == 2)
        m[k] = __vmaxu2(m[k], w[k] & kBf16AbsMask2);
      else
        m[k] = max(m[k], w[k] & kAbsMask);
    }
  }
}

// e4m3 bytes of a chunk, element e scaled by inv[e]; hardware conversion (finite inputs).
template <typename In>
__device__ __forceinline__ void quantize_chunk(const uint4& v, const float (&inv)[QuantTileMap<In>::kElems],
                                               uint32_t (&q)[QuantTileMap<In>::kOutWords]) {
#pragma unroll
  for (int o = 0; o < QuantTileMap<In>::kOutWords; ++o) {
    const int e = 4 * o;
    const uint32_t lo = e4m3x2_satfinite(chunk_element<In>(v, e) * inv[e], chunk_element<In>(v, e + 1) * inv[e + 1]);
    const uint32_t hi =
        e4m3x2_satfinite(chunk_element<In>(v, e + 2) * inv[e + 2], chunk_element<In>(v, e + 3) * inv[e + 3]);
    q[o] = lo | (hi << 16);
  }
}

// fp32 bits of element e of a row of x (bf16 widens by a shift).
template <typename In>
__device__ __forceinline__ uint32_t x_bits(const In* row, int e) {
  if constexpr (sizeof(In) == 2)
    return uint32_t(row[e]) << 16;
  else
    return __float_as_uint(row[e]);
}

// Rare path for blocks holding inf or NaN (exactly the blocks with scale 0xFF): after the normal
// bytes are written, rewrite those of the non-finite elements (finite ones are already right).
// A rolled loop that re-reads x keeps it from costing registers on the common path; the bytes
// were written by this thread, so program order makes the rewrite win.
//  x_row: kElems values of x; dst(e): where element e's byte went.
template <typename In, typename Dst>
__device__ __forceinline__ void patch_nonfinite(const In* x_row, Dst dst) {
#pragma unroll 1
  for (int e = 0; e < QuantTileMap<In>::kElems; ++e) {
    const uint32_t u = x_bits(x_row, e);
    if ((u & kExpAllOnes) == kExpAllOnes) *dst(e) = uint8_t(e4m3_nonfinite_byte(u));
  }
}

template <int kWords>
__device__ __forceinline__ void store_words(uint8_t* dst, const uint32_t (&q)[kWords]) {
  if constexpr (kWords == 2)
    *reinterpret_cast<uint2*>(dst) = make_uint2(q[0], q[1]);
  else
    *reinterpret_cast<uint32_t*>(dst) = q[0];
}

template <typename In, bool kHdim, TokOut kTok, bool kTokContiguous>
__global__ void __launch_bounds__(kTileThreads) quantize_kernel(const QuantizeParams p) {
  using M = QuantTileMap<In>;
  // Column maxima of each warp's rows: |bf16| bits or |fp32| bits.
  using ColMax = std::conditional_t<sizeof(In) == 2, uint16_t, uint32_t>;
  __shared__ alignas(16) ColMax s_colmax[kTileWarps][kHeadDim];
  __shared__ alignas(16) float s_inv[kHeadDim];   // 1/scale of column d's block
  __shared__ uint32_t s_nan_columns[kTileWarps];  // bit d mod 32 of word d / 32: column d's scale is NaN
  __shared__ alignas(16) uint32_t s_tile[kTileSmemWords];

  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int chunk = tid % M::kChunksPerRow;
  const int row0 = tid / M::kChunksPerRow * M::kRows;
  const int col0 = chunk * M::kElems;
  const int hdim_block = col0 / kBlockSize;
  const int64_t H = p.jd.H, P = p.jd.P;
  const int64_t row_elems = H * kHeadDim;  // elements from one token to the next in x and payloads
  const In* x = static_cast<const In*>(p.x);
  // Shared-tile words this thread writes: (columns col0 + 4 cw + j, tokens of quad row0 / 4 + rq).
  int tile_word[M::kRows / 4][M::kOutWords][4];
#pragma unroll
  for (int rq = 0; rq < M::kRows / 4; ++rq)
#pragma unroll
    for (int cw = 0; cw < M::kOutWords; ++cw)
#pragma unroll
      for (int j = 0; j < 4; ++j) tile_word[rq][cw][j] = tile_word_index(col0 + 4 * cw + j, row0 / 4 + rq);

  const TileHalves halves(P);
  SequenceCursor sequence(p.jd);
  for (TileWalker tw(blockIdx.x, gridDim.x, p.num_groups, H); tw.valid(); tw.next()) {
    const int64_t g = tw.g, h = tw.h;
    const GroupSpan span = sequence.span(g);
    const int n_valid = span.n_valid;
    // Element offset of this thread's first row in x and in token-major payloads.
    const int64_t off0 = int64_t(span.t_first + row0) * row_elems + h * kHeadDim + col0;
    const int64_t atom = blocked_atom_base(h, g, P);
    const int group_col = int(g % kGroupsPerAtom);

    // hdim scale of this lane's block in its first row and the step to the next row. Blocked:
    // hdim_blocked_offset(h, 32 g + r, k, P). Plain (T, H, 4): one byte per 32 elements of x, so
    // the element offset / 32.
    const int64_t hdim_scale0 =
        p.blocked ? atom + 16 * row0 + 4 * group_col + hdim_block : int64_t(uint64_t(off0) / kBlockSize);
    const int64_t hdim_scale_stride = p.blocked ? int64_t(16) : row_elems / kBlockSize;

    uint4 v[M::kRows];
#pragma unroll
    for (int i = 0; i < M::kRows; ++i) {
      v[i] = make_uint4(0, 0, 0, 0);
      if (row0 + i < n_valid) v[i] = __ldcs(reinterpret_cast<const uint4*>(x + off0 + i * row_elems));
    }

    // hdim: block maxima of all kRows rows (butterfly over the kLanesPerBlock lanes of a block).
    // Lane j of a block then computes the scale of row j only, stores its byte and shares 1/scale
    // (kLanesPerBlock == kRows), so no scale is computed twice.
    float hdim_inv[M::kRows];
    if constexpr (kHdim) {
      uint32_t amax[M::kRows];
#pragma unroll
      for (int i = 0; i < M::kRows; ++i) amax[i] = chunk_amax_bits<In>(v[i]);
#pragma unroll
      for (int o = 1; o < M::kLanesPerBlock; o <<= 1) {
#pragma unroll
        for (int i = 0; i < M::kRows; ++i) amax[i] = max(amax[i], __shfl_xor_sync(~0u, amax[i], o));
      }
      const int my_row = lane & (M::kLanesPerBlock - 1);
      uint32_t my_amax = amax[0];
#pragma unroll
      for (int i = 1; i < M::kRows; ++i) my_amax = my_row == i ? amax[i] : my_amax;
      const uint32_t my_scale = scale_byte_from_amax_bits(my_amax, p.mode);
      // Blocked: padding rows too (their zero data gives scale 0).
      if (p.blocked || row0 + my_row < n_valid)
        p.hdim_scales[hdim_scale0 + my_row * hdim_scale_stride] = uint8_t(my_scale);
      const float my_inv = e8m0_inv_scale(uint8_t(my_scale));
#pragma unroll
      for (int i = 0; i < M::kRows; ++i) hdim_inv[i] = __shfl_sync(~0u, my_inv, (lane & ~(M::kLanesPerBlock - 1)) | i);
    }
    // hdim payload of row i. With a seq/square32 output too it runs in that output's row loop,
    // so each value is widened to fp32 once for both.
    const auto hdim_row = [&](int i) {
      float inv[M::kElems];
#pragma unroll
      for (int e = 0; e < M::kElems; ++e) inv[e] = hdim_inv[i];
      uint32_t q[M::kOutWords];
      quantize_chunk<In>(v[i], inv, q);
      if (row0 + i < n_valid) {
        const int64_t off = off0 + i * row_elems;
        store_words(p.hdim_payload + off, q);
        // 1/scale 2^-127 is scale 0xFF (finite blocks give bytes <= 247): the only blocks that
        // can hold inf/NaN.
        if (__float_as_uint(hdim_inv[i]) == kInvScaleOfNan) {
          uint8_t* dst = p.hdim_payload + off;
          patch_nonfinite(x + off, [dst](int e) { return dst + e; });
        }
      }
    };
    if constexpr (kHdim && kTok == TokOut::kNone) {
#pragma unroll
      for (int i = 0; i < M::kRows; ++i) hdim_row(i);
    }

    if constexpr (kTok != TokOut::kNone) {
      uint32_t cm[4];
      column_amax<In>(v, cm);
      if constexpr (sizeof(In) == 2) {
        // Lanes l and l ^ 16 hold the same columns (rows 4 apart).
#pragma unroll
        for (int k = 0; k < 4; ++k) cm[k] = __vmaxu2(cm[k], __shfl_xor_sync(~0u, cm[k], 16));
        if (lane < 16) *reinterpret_cast<uint4*>(&s_colmax[warp][col0]) = make_uint4(cm[0], cm[1], cm[2], cm[3]);
      } else {
        *reinterpret_cast<uint4*>(&s_colmax[warp][col0]) = make_uint4(cm[0], cm[1], cm[2], cm[3]);
      }
      __syncthreads();
      {
        const int d = tid;  // one thread per column; warp w holds head-dim block w
        uint32_t amax = 0;
#pragma unroll
        for (int w = 0; w < kTileWarps; ++w) amax = max(amax, uint32_t(s_colmax[w][d]) << (sizeof(In) == 2 ? 16 : 0));
        if constexpr (kTok == TokOut::kSquare32) {
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) amax = max(amax, __shfl_xor_sync(~0u, amax, o));
        }
        const uint32_t s = scale_byte_from_amax_bits(amax, p.mode);
        s_inv[d] = e8m0_inv_scale(uint8_t(s));
        const uint32_t nan_columns = __ballot_sync(~0u, s == kE8m0Nan);
        if (lane == 0) s_nan_columns[warp] = nan_columns;
        if constexpr (kTok == TokOut::kSeq) {
          p.tok_scales[p.blocked ? atom + 16 * (d % 32) + 4 * (d / 32) + group_col : seq_plain_offset(g, h, d, H)] =
              uint8_t(s);
        } else if (p.blocked) {
          // Each token row of the blocked tensor carries its block's scale; padding rows hold 0.
          p.tok_scales[atom + 16 * lane + 4 * group_col + warp] = lane < n_valid ? uint8_t(s) : uint8_t(0);
        } else if (lane == 0) {
          p.tok_scales[square_plain_offset(g, h, warp, H)] = uint8_t(s);
        }
      }
      __syncthreads();

      float inv[M::kElems];
#pragma unroll
      for (int k = 0; k < M::kElems / 4; ++k) {
        const float4 f = *reinterpret_cast<const float4*>(&s_inv[col0 + 4 * k]);
        inv[4 * k] = f.x, inv[4 * k + 1] = f.y, inv[4 * k + 2] = f.z, inv[4 * k + 3] = f.w;
      }
      const bool any_nan_scale = ((s_nan_columns[col0 / 32] >> (col0 % 32)) & ((1u << M::kElems) - 1u)) != 0;
      uint32_t q[M::kRows][M::kOutWords];
#pragma unroll
      for (int i = 0; i < M::kRows; ++i) {
        if constexpr (kHdim) hdim_row(i);
        quantize_chunk<In>(v[i], inv, q[i]);
      }

      if constexpr (!kTokContiguous) {
#pragma unroll
        for (int i = 0; i < M::kRows; ++i)
          if (row0 + i < n_valid) store_words(p.tok_payload + off0 + i * row_elems, q[i]);
        if (any_nan_scale) {
#pragma unroll 1
          for (int i = 0; i < n_valid - row0 && i < M::kRows; ++i) {
            uint8_t* dst = p.tok_payload + off0 + i * row_elems;
            patch_nonfinite(x + off0 + i * row_elems, [dst](int e) { return dst + e; });
          }
        }
      } else {
        // Transpose 4 tokens x 4 columns at a time into column words; s_tile's previous readers
        // finished before the first barrier of this tile.
#pragma unroll
        for (int rq = 0; rq < M::kRows / 4; ++rq) {
#pragma unroll
          for (int cw = 0; cw < M::kOutWords; ++cw) {
            uint32_t a[4] = {q[4 * rq][cw], q[4 * rq + 1][cw], q[4 * rq + 2][cw], q[4 * rq + 3][cw]};
            transpose4x4_bytes(a);
#pragma unroll
            for (int j = 0; j < 4; ++j) s_tile[tile_word[rq][cw][j]] = a[j];
          }
        }
        if (any_nan_scale) {
          // Padding rows are zeros, so only real rows can hold inf/NaN.
          uint8_t* tile_bytes = reinterpret_cast<uint8_t*>(s_tile);
#pragma unroll 1
          for (int i = 0; i < n_valid - row0 && i < M::kRows; ++i) {
            const int r = row0 + i;
            patch_nonfinite(x + off0 + i * row_elems,
                            [=](int e) { return tile_bytes + 4 * tile_word_index(col0 + e, r / 4) + r % 4; });
          }
        }
        __syncthreads();
        tile_store_contiguous(s_tile, halves, p.tok_payload + contiguous_tile_offset(h, g, P));
      }
    }
  }
}

}  // namespace mxflash::cuda
