// The quantization kernel: one read of x (T, H, 128) produces the hdim output, the seq or square32
// output, or both. Launched from quantize_launch.cuh, instantiated per input type in
// quantize_bf16.cu and quantize_fp32.cu.
//
// Work: grid-stride over strips (4 tiles = 128 padded tokens of one head, token_tile.cuh); 128
// threads process the strip's tiles of 32 tokens x 128 columns one after another, the loads of the
// next tile issued before the current one is processed. Each thread loads kRows 16-byte chunks of
// one chunk column, so a warp reads whole 256/512-byte rows: fully coalesced.
//  hdim:     block = the kLanesPerBlock lanes covering 32 columns of a row: butterfly max; lane j
//            of the block computes row j's scale and shares 1/scale. No barrier.
//  seq:      block = one column over the tile's 32 tokens: per-thread max over its rows, shuffle
//            (bf16: the two half-warps share a chunk column), then the 4 warps through shared
//            memory; thread d computes column d's scale and publishes 1/scale.
//  square32: the seq column maxima reduced over the 32 columns of warp d/32.
//  token-contiguous payloads are transposed into a shared strip and leave as 128-byte lines.
// Rows past the sequence end are zeros (the reference's zero padding): they give zero bytes in a
// token-contiguous payload and scale 0 in a padding group, which is what those bytes must hold;
// tiles with no real token write those zeros directly.
// Elements use the hardware e4m3 conversion; blocks with scale 0xFF (holding inf/NaN) get their
// non-finite elements patched afterwards (mx_device.cuh has the proof obligations).
//
// Measured on an H200, 1 GiB of bf16 input, % of device-to-device copy bandwidth (read + write
// bytes), one CTA per strip (the default launch): hdim 99, seq / square32 token-major 99-100,
// token-contiguous 90-91, hdim+seq 91-93 (token-contiguous 86); docs/performance.md. With one
// resident wave of CTAs (the former launch) 8-10 points less: its last round of strips ran on a
// fraction of the CTAs. (mxflash-bench --workload quantize measures these.)
// quantize_hdim_seq_kernel.cuh is a leaner bf16 hdim+seq kernel (same bytes, ~40% fewer
// instructions per tile, 7 CTAs/SM, two tiles of loads in flight): measured at the same speed, so
// hdim+seq is not issue- or latency-bound. MXFLASH_QUANT_VARIANT (quantize_launch.cuh) selects it,
// the staged scale atoms (store_staged_atoms below) and the resident wave at run time.
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

// Zero outputs of a tile with no real token (a strip's tail in a short sequence): the bytes the
// full path writes for all-zero data, without loads, arithmetic or barriers.
// kStage: blocked scales go to the strip's staged atoms (s_hdim_atom, s_tok_atom) instead.
template <bool kHdim, TokOut kTok, bool kTokContiguous, bool kStage = false>
__device__ __forceinline__ void zero_tile(const QuantizeParams& p, int64_t g, int64_t h, int64_t atom, int k,
                                          uint32_t* s_strip_tile, uint8_t* s_hdim_atom = nullptr,
                                          uint8_t* s_tok_atom = nullptr) {
  const int tid = int(threadIdx.x);
  // Blocked hdim / square32 scales: 32 rows x 4 blocks of the atom column k; thread t: row t / 4.
  const int64_t blocked_row_byte = atom + 16 * (tid / 4) + 4 * k + (tid % 4);
  if constexpr (kStage) {
    const int atom_row_byte = 16 * (tid / 4) + 4 * k + (tid % 4);
    if constexpr (kHdim) s_hdim_atom[atom_row_byte] = 0;
    if constexpr (kTok == TokOut::kSeq) s_tok_atom[16 * (tid % 32) + 4 * (tid / 32) + k] = 0;
    if constexpr (kTok == TokOut::kSquare32) s_tok_atom[atom_row_byte] = 0;
  } else {
    if constexpr (kHdim) {
      if (p.blocked) p.hdim_scales[blocked_row_byte] = 0;
    }
    if constexpr (kTok == TokOut::kSeq) {
      p.tok_scales[p.blocked ? atom + 16 * (tid % 32) + 4 * (tid / 32) + k : seq_plain_offset(g, h, tid, p.jd.H)] = 0;
    } else if constexpr (kTok == TokOut::kSquare32) {
      if (p.blocked)
        p.tok_scales[blocked_row_byte] = 0;
      else if (tid < kHeadDim / kBlockSize)
        p.tok_scales[square_plain_offset(g, h, tid, p.jd.H)] = 0;
    }
  }
  if constexpr (kTokContiguous) {
    // The tile's 4 KB of the shared strip, whatever the swizzle: word v * 128 + t, as 16 bytes.
    static_assert(kTileSmemWords == 8 * kTileThreads, "two 16-byte zero stores per thread");
    reinterpret_cast<uint4*>(s_strip_tile)[tid] = make_uint4(0, 0, 0, 0);
    reinterpret_cast<uint4*>(s_strip_tile)[tid + kTileThreads] = make_uint4(0, 0, 0, 0);
  }
}

// ---------------------------------------------------------------- staged blocked scale atoms
// Blocked scales (REFERENCE.md §3) put a strip's 4 tiles into one 512-byte atom, each tile 128
// bytes spread over all 16 sectors of it (hdim: bytes 4k..4k+3 of every 16-byte row; seq: byte k of
// every 4). Written straight to global memory, every sector of the atom is partially written four
// times, a tile time (~4 us at full bandwidth) apart. The L2 turns over in a few tile times at
// these rates, so a sector evicted while partial costs the HBM a read-modify-write (no byte masks
// with ECC), and a 32-byte burst per 8 bytes in any case. Staged (MXFLASH_QUANT_VARIANT bit 1,
// quantize_launch.cuh), the tiles write the atom's bytes into shared memory at the same offsets and
// one warp per atom writes it after the strip: 32 x 16 bytes, four whole 128-byte lines, once.
// Two buffers, by strip parity: a barrier at the end of every strip precedes the store; the next
// strip's tiles write the other buffer while warps 0 and 1 may still be reading this one, and that
// strip's own end barrier separates these reads from the writes of the strip after it.
inline constexpr int kStagedAtomWords = kAtomBytes / 4;  // 128 words = 32 uint4 per atom

// The staged atoms of a strip to global memory: warp 0 the hdim atom, warp 1 the seq/square32 one.
__device__ __forceinline__ void store_staged_atoms(const uint32_t* s_hdim_atom, const uint32_t* s_tok_atom,
                                                   uint8_t* hdim_atom_dst, uint8_t* tok_atom_dst) {
  const int tid = int(threadIdx.x);
  static_assert(kAtomBytes == 32 * 16, "one warp, one 16-byte vector per lane, per atom");
  if (tid < 32) {
    if (hdim_atom_dst)
      reinterpret_cast<uint4*>(hdim_atom_dst)[tid] = reinterpret_cast<const uint4*>(s_hdim_atom)[tid];
  } else if (tid < 64) {
    if (tok_atom_dst)
      reinterpret_cast<uint4*>(tok_atom_dst)[tid - 32] = reinterpret_cast<const uint4*>(s_tok_atom)[tid - 32];
  }
}

// Resident CTAs per SM the register allocation must allow (__launch_bounds__): with one tile being
// processed and the next one loading, 6 to 8 (bf16) or 4 to 5 (fp32) CTAs keep 100 to 160 KB of
// loads in flight per SM.
// Tighter bounds make ptxas spill (checked with -Xptxas -v).
template <typename In, bool kHdim, TokOut kTok>
inline constexpr int kQuantizeMinBlocks = sizeof(In) == 2 ? (kTok == TokOut::kNone ? 8 : (kHdim ? 6 : 8))
                                                          : (kTok == TokOut::kNone ? 5 : (kHdim ? 4 : 5));

// kStageScales: blocked scale atoms staged in shared memory and written once per strip (see
// store_staged_atoms); the launcher selects it only for the blocked layout with 16-byte aligned
// scale tensors.
template <typename In, bool kHdim, TokOut kTok, bool kTokContiguous, bool kStageScales = false>
__global__ void __launch_bounds__(kTileThreads, kQuantizeMinBlocks<In, kHdim, kTok>)
    quantize_kernel(const QuantizeParams p) {
  using M = QuantTileMap<In>;
  // Column maxima of each warp's rows: |bf16| bits or |fp32| bits.
  using ColMax = std::conditional_t<sizeof(In) == 2, uint16_t, uint32_t>;
  __shared__ alignas(16) ColMax s_colmax[kTileWarps][kHeadDim];
  __shared__ alignas(16) float s_inv[kHeadDim];   // 1/scale of column d's block
  __shared__ uint32_t s_nan_columns[kTileWarps];  // bit d mod 32 of word d / 32: column d's scale is NaN
  __shared__ alignas(16) uint32_t s_strip[kTokContiguous ? kStripSmemWords : 4];
  // Staged blocked scale atoms: [strip parity][hdim, seq/square32].
  __shared__ alignas(16) uint32_t s_atoms[kStageScales ? 2 : 1][2][kStageScales ? kStagedAtomWords : 4];

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

  // x of a tile into registers: tile k of the strip at `strip_pos` (zeros past the sequence end).
  const auto load_tile = [&](uint4(&dst)[M::kRows], const SequencePos& strip_pos, int64_t h, int k) {
    const int n = strip_pos.count - k * kTileTokens;
    const In* src = x + int64_t(strip_pos.t_first + k * kTileTokens + row0) * row_elems + h * kHeadDim + col0;
#pragma unroll
    for (int i = 0; i < M::kRows; ++i) {
      dst[i] = make_uint4(0, 0, 0, 0);
      // Plain read-only loads: an evict-first hint (__ldcs) here cost 10% of the bandwidth (measured).
      if (row0 + i < n) dst[i] = __ldg(reinterpret_cast<const uint4*>(src + i * row_elems));
    }
  };

  // Software pipeline: the loads of the next tile (the next one of this strip, or tile 0 of the
  // next strip) are issued before the current tile is processed, so every CTA keeps a tile of
  // loads in flight through its arithmetic and barriers.
  SequenceCursor sequence(p.jd);
  TileWalker tw(blockIdx.x, gridDim.x, p.num_groups / kStripTiles, H);
  if (!tw.valid()) return;                                      // the whole CTA: no barrier is skipped by part of it
  SequencePos next_pos = sequence.locate(tw.g * kStripTokens);  // a strip is inside one sequence
  uint4 v_next[M::kRows];
  load_tile(v_next, next_pos, tw.h, 0);
  int parity = 0;  // kStageScales: which s_atoms buffer this strip uses
  for (;;) {
    const int64_t strip = tw.g, h = tw.h;
    const SequencePos pos = next_pos;
    TileWalker following = tw;
    following.next();
    const int64_t atom = blocked_atom_base(h, strip * kStripTiles, P);
    uint8_t* const s_hdim_atom = reinterpret_cast<uint8_t*>(s_atoms[kStageScales ? parity : 0][0]);
    uint8_t* const s_tok_atom = reinterpret_cast<uint8_t*>(s_atoms[kStageScales ? parity : 0][1]);

#pragma unroll 1
    for (int k = 0; k < kStripTiles; ++k) {
      uint4 v[M::kRows];
#pragma unroll
      for (int i = 0; i < M::kRows; ++i) v[i] = v_next[i];
      if (k + 1 < kStripTiles) {
        load_tile(v_next, pos, h, k + 1);
      } else if (following.valid()) {
        next_pos = sequence.locate(following.g * kStripTokens);
        load_tile(v_next, next_pos, following.h, 0);
      }

      const int64_t g = strip * kStripTiles + k;
      const int rest = pos.count - k * kTileTokens;
      const int n_valid = rest < 0 ? 0 : (rest > kTileTokens ? kTileTokens : rest);
      // Tile 0 always holds a real token (a sequence's padded chunk starts with one), so its
      // barriers separate the previous strip's readers of s_strip from this strip's writers.
      if (n_valid == 0) {
        zero_tile<kHdim, kTok, kTokContiguous, kStageScales>(p, g, h, atom, k, s_strip + k * kTileSmemWords,
                                                             s_hdim_atom, s_tok_atom);
        continue;  // n_valid is the same in the whole CTA: no barrier is skipped by part of it
      }
      // Element offset of this thread's first row in x and in token-major payloads.
      const int64_t off0 = int64_t(pos.t_first + k * kTileTokens + row0) * row_elems + h * kHeadDim + col0;
      // hdim scale of this lane's block in its first row and the step to the next row. Blocked:
      // hdim_blocked_offset(h, 32 g + r, kb, P) = atom + 16 r + 4 k + kb. Plain (T, H, 4): one
      // byte per 32 elements of x, so the element offset / 32.
      const int64_t hdim_scale0 =
          p.blocked ? atom + 16 * row0 + 4 * k + hdim_block : int64_t(uint64_t(off0) / kBlockSize);
      const int64_t hdim_scale_stride = p.blocked ? int64_t(16) : row_elems / kBlockSize;

      // hdim: block maxima of all kRows rows (butterfly over the kLanesPerBlock lanes of a block).
      // Lane j of a block then computes the scale of row j only, stores its byte and shares
      // 1/scale (kLanesPerBlock == kRows), so no scale is computed twice.
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
        if constexpr (kStageScales)
          s_hdim_atom[16 * (row0 + my_row) + 4 * k + hdim_block] = uint8_t(my_scale);
        else if (p.blocked || row0 + my_row < n_valid)
          p.hdim_scales[hdim_scale0 + my_row * hdim_scale_stride] = uint8_t(my_scale);
        const float my_inv = e8m0_inv_scale(uint8_t(my_scale));
#pragma unroll
        for (int i = 0; i < M::kRows; ++i)
          hdim_inv[i] = __shfl_sync(~0u, my_inv, (lane & ~(M::kLanesPerBlock - 1)) | i);
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
          for (int c = 0; c < 4; ++c) cm[c] = __vmaxu2(cm[c], __shfl_xor_sync(~0u, cm[c], 16));
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
          if constexpr (kStageScales) {
            if constexpr (kTok == TokOut::kSeq)
              s_tok_atom[16 * (d % 32) + 4 * (d / 32) + k] = uint8_t(s);
            else
              s_tok_atom[16 * lane + 4 * k + warp] = lane < n_valid ? uint8_t(s) : uint8_t(0);
          } else if constexpr (kTok == TokOut::kSeq) {
            p.tok_scales[p.blocked ? atom + 16 * (d % 32) + 4 * (d / 32) + k : seq_plain_offset(g, h, d, H)] =
                uint8_t(s);
          } else if (p.blocked) {
            // Each token row of the blocked tensor carries its block's scale; padding rows hold 0.
            p.tok_scales[atom + 16 * lane + 4 * k + warp] = lane < n_valid ? uint8_t(s) : uint8_t(0);
          } else if (lane == 0) {
            p.tok_scales[square_plain_offset(g, h, warp, H)] = uint8_t(s);
          }
        }
        __syncthreads();

        float inv[M::kElems];
#pragma unroll
        for (int c = 0; c < M::kElems / 4; ++c) {
          const float4 f = *reinterpret_cast<const float4*>(&s_inv[col0 + 4 * c]);
          inv[4 * c] = f.x, inv[4 * c + 1] = f.y, inv[4 * c + 2] = f.z, inv[4 * c + 3] = f.w;
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
          // Transpose 4 tokens x 4 columns at a time into column words of tile k of the strip.
          uint32_t* tile = s_strip + k * kTileSmemWords;
          const int row_xor = k << 3;  // strip_word_index: tile k's rows XORed with k
#pragma unroll
          for (int rq = 0; rq < M::kRows / 4; ++rq) {
#pragma unroll
            for (int cw = 0; cw < M::kOutWords; ++cw) {
              uint32_t a[4] = {q[4 * rq][cw], q[4 * rq + 1][cw], q[4 * rq + 2][cw], q[4 * rq + 3][cw]};
              transpose4x4_bytes(a);
#pragma unroll
              for (int j = 0; j < 4; ++j) tile[tile_word[rq][cw][j] ^ row_xor] = a[j];
            }
          }
          if (any_nan_scale) {
            // Padding rows are zeros, so only real rows can hold inf/NaN.
            uint8_t* strip_bytes = reinterpret_cast<uint8_t*>(s_strip);
#pragma unroll 1
            for (int i = 0; i < n_valid - row0 && i < M::kRows; ++i) {
              const int r = row0 + i;
              patch_nonfinite(x + off0 + i * row_elems,
                              [=](int e) { return strip_bytes + 4 * strip_word_index(k, col0 + e, r / 4) + r % 4; });
            }
          }
        }
      }
    }

    if constexpr (kTokContiguous || kStageScales) __syncthreads();
    if constexpr (kTokContiguous)
      strip_store_contiguous(s_strip, p.tok_payload + h * kHeadDim * P + strip * kStripTokens, P);
    if constexpr (kStageScales) {
      store_staged_atoms(s_atoms[parity][0], s_atoms[parity][1], kHdim ? p.hdim_scales + atom : nullptr,
                         kTok != TokOut::kNone ? p.tok_scales + atom : nullptr);
      parity ^= 1;
    }
    if (!following.valid()) break;
    tw = following;
  }
}

}  // namespace mxflash::cuda
