// The unit of work of every quantization kernel: a tile of 32 padded tokens (one MX block along the
// sequence) x 128 head-dim columns of one head. Tiles walk the padded token axis (P/32 groups per
// head), so every padding byte of a P-indexed output (blocked scales, seq/square32 scales,
// token-contiguous payloads) belongs to exactly one tile and is written in the same pass.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "mxflash/mx.h"

namespace mxflash::cuda {

inline constexpr int kTileTokens = kBlockSize;  // 32: one seq / square32 block of tokens
inline constexpr int kTileThreads = 128;        // 4 warps per tile
inline constexpr int kTileWarps = kTileThreads / 32;
inline constexpr int kAtomBytes = 512;  // 128 rows x 4 columns of scale bytes (REFERENCE.md §3)
inline constexpr int kAtomRows = 128;
inline constexpr int kGroupsPerAtom = kAtomRows / kTileTokens;  // 4

struct JaggedDevice {
  const int32_t* cu_seqlens;     // B+1, device
  const int32_t* cu_seqlens_sf;  // B+1, device
  int batch;
  int64_t P;  // padded tokens
  int64_t H;  // heads
};

// Real tokens of padded group g: [t_first, t_first + n_valid), n_valid in [0, 32]. Token indices
// fit in int32 (JaggedMeta checks T and P); element offsets are formed in 64 bits.
struct GroupSpan {
  int t_first;
  int n_valid;
};

// Real tokens from padded token tp on: [t_first, t_first + count), count unclamped (<= 0 when tp is
// padding).
struct SequencePos {
  int t_first;
  int count;
};

// Sequence of a padded token, for a walk whose padded token never decreases (TileWalker). It keeps
// the current sequence: tiles inside one long sequence cost no memory access. A move probes the
// next 32 sequence starts at once, one per lane (one load for a jump over up to 32 sequences),
// and falls back to a binary search for longer jumps. The sequence holding padded token tp is
// the last b with cu_seqlens_sf[b] <= tp (an empty sequence shares its start with the next one,
// so the last match skips it). All 32 lanes of a warp must call it with the same tp.
class SequenceCursor {
 public:
  __device__ explicit SequenceCursor(const JaggedDevice& d) : d_(d) { load(0); }

  __device__ SequencePos locate(int64_t padded_token) {
    const int tp = int(padded_token);  // P fits in int32 (JaggedMeta checks it)
    if (tp >= sf_end_) seek(tp);
    const int offset = tp - sf_begin_;
    return SequencePos{t_begin_ + offset, len_ - offset};
  }
  // Real tokens of padded group g (at most 32).
  __device__ GroupSpan span(int64_t g) {
    const SequencePos s = locate(g * kTileTokens);
    return GroupSpan{s.t_first, s.count < 0 ? 0 : (s.count > kTileTokens ? kTileTokens : s.count)};
  }

 private:
  __device__ void load(int b) {
    b_ = b;
    sf_begin_ = __ldg(d_.cu_seqlens_sf + b);
    sf_end_ = __ldg(d_.cu_seqlens_sf + b + 1);
    t_begin_ = __ldg(d_.cu_seqlens + b);
    len_ = __ldg(d_.cu_seqlens + b + 1) - t_begin_;
  }
  // Called with cu_seqlens_sf[b_ + 1] <= tp; cu_seqlens_sf[batch] = P > tp bounds the search.
  __device__ void seek(int tp) {
    const int lane = int(threadIdx.x) & 31;
    const int probe = b_ + 1 + lane;
    const bool started = probe <= d_.batch && __ldg(d_.cu_seqlens_sf + probe) <= tp;
    const unsigned started_mask = __ballot_sync(~0u, started);  // a prefix of lanes: starts are sorted
    if (started_mask != ~0u) {
      load(b_ + __popc(started_mask));
      return;
    }
    int lo = b_ + 32, hi = d_.batch;  // cu_sf[lo] <= tp < cu_sf[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (__ldg(d_.cu_seqlens_sf + mid) <= tp)
        lo = mid;
      else
        hi = mid;
    }
    load(lo);
  }

  JaggedDevice d_;
  int b_, sf_begin_, sf_end_, t_begin_, len_;
};

// Grid-stride walk over work units (g, h) -- tiles (padded group g of head h) or strips of tiles --
// h fastest so that concurrently running CTAs read adjacent memory. Keeps (g, h) incrementally:
// one 64-bit division per thread instead of one per unit.
struct TileWalker {
  int64_t g, h, dg, dh, H, num_groups;
  __device__ TileWalker(int64_t first, int64_t stride, int64_t groups, int64_t heads) : H(heads), num_groups(groups) {
    g = first / heads;
    h = first - g * heads;
    dg = stride / heads;
    dh = stride - dg * heads;
  }
  __device__ bool valid() const { return g < num_groups; }
  __device__ void next() {
    g += dg;
    h += dh;
    if (h >= H) {
      h -= H;
      ++g;
    }
  }
};

// Byte offset of the 512-byte atom holding rows [32g, 32g+32) of head h in a blocked scale tensor
// (hdim: rows are padded tokens; seq: the atom of token-group quad g/4), plus the column of group g
// inside it. hdim_blocked_offset(h, 32g + r, k, P) = base + 16 r + 4 (g mod 4) + k, and
// seq_blocked_offset(h, d, g, P) = base + 16 (d mod 32) + 4 (d / 32) + (g mod 4).
__device__ __forceinline__ int64_t blocked_atom_base(int64_t h, int64_t g, int64_t P) {
  return int64_t(kAtomBytes) * (h * (P / kAtomRows) + g / kGroupsPerAtom);
}

// Thread layout over a tile of e4m3 bytes (dequantize, layout converters): thread t holds 4 rows
// x 8 columns, rows from 4 (t / 16), columns from 8 (t mod 16); a warp's 8-byte loads cover two
// 128-byte rows. Also the layout of the quantizer's bf16 path, so all share the transpose below.
inline constexpr int kByteTileCols = 8;
inline constexpr int kByteTileChunksPerRow = kHeadDim / kByteTileCols;                    // 16
inline constexpr int kByteTileRows = kTileTokens * kByteTileChunksPerRow / kTileThreads;  // 4
static_assert(kByteTileRows == 4, "one 4x4 byte transpose per 4 columns");

// ---------------------------------------------------------------- token-contiguous staging
// A tile of bytes transposed in shared memory: one 32-byte row per head-dim column d holding its
// 32 tokens, as 8 words of 4 tokens. Threads that own (4 tokens x 4 columns) of the token-major
// tile write single words; lane pairs read 16-byte halves of a column for 16-byte global stores
// (and the reverse for loads). Swizzle: rows are permuted (d ^ ((d >> 3) & 3)) and the two halves
// of a row swapped when bit 5 of d is set. Half-column accesses are then conflict-free, word
// writes 2-way (bf16 thread layout) or 4-way (fp32) conflicted (bank simulation of every access
// pattern). A swizzle inside the halves removes those conflicts but costs readers 8 selects per
// half to restore the order, and issue slots are the scarcer resource here.
inline constexpr int kTileWordsPerColumn = kTileTokens / 4;  // 8
inline constexpr int kTileSmemWords = kHeadDim * kTileWordsPerColumn;

__device__ __forceinline__ int tile_row(int d) { return d ^ ((d >> 3) & 3); }
__device__ __forceinline__ int tile_half_swap(int d) { return (d >> 5) & 1; }
// Word of tokens [4w, 4w+4) of column d.
__device__ __forceinline__ int tile_word_index(int d, int w) {
  return tile_row(d) * kTileWordsPerColumn + (w ^ (tile_half_swap(d) << 2));
}
// First word of the 16-byte half `half` (tokens [16 half, 16 half + 16)) of column d.
__device__ __forceinline__ int tile_half_index(int d, int half) {
  return tile_row(d) * kTileWordsPerColumn + 4 * (half ^ tile_half_swap(d));
}

// The half columns a thread moves: 128 columns x 2 halves over 128 threads. Offsets are loop
// invariant, computed once per thread.
inline constexpr int kTileHalvesPerThread = 2 * kHeadDim / kTileThreads;
struct TileHalves {
  int smem[kTileHalvesPerThread];        // word index in the shared tile
  int64_t global[kTileHalvesPerThread];  // byte offset in a (H, 128, P) payload from (h, 0, 32g)
  __device__ explicit TileHalves(int64_t P) {
#pragma unroll
    for (int i = 0; i < kTileHalvesPerThread; ++i) {
      const int u = i * kTileThreads + int(threadIdx.x);
      const int d = u >> 1, half = u & 1;  // lane pairs cover a 32-byte sector
      smem[i] = tile_half_index(d, half);
      global[i] = d * P + 16 * half;
    }
  }
};

// Byte offset of tile (g, h) in a token-contiguous payload (H, 128, P).
__device__ __forceinline__ int64_t contiguous_tile_offset(int64_t h, int64_t g, int64_t P) {
  return h * kHeadDim * P + g * kTileTokens;
}

// Shared tile -> token-contiguous payload at `tile` (= payload + contiguous_tile_offset).
__device__ __forceinline__ void tile_store_contiguous(const uint32_t* s, const TileHalves& th, uint8_t* tile) {
#pragma unroll
  for (int i = 0; i < kTileHalvesPerThread; ++i)
    *reinterpret_cast<uint4*>(tile + th.global[i]) = *reinterpret_cast<const uint4*>(s + th.smem[i]);
}

// Token-contiguous payload at `tile` -> shared tile (padding tokens come along; callers ignore them).
__device__ __forceinline__ void tile_load_contiguous(uint32_t* s, const TileHalves& th, const uint8_t* tile) {
  uint4 v[kTileHalvesPerThread];
#pragma unroll
  for (int i = 0; i < kTileHalvesPerThread; ++i) v[i] = __ldg(reinterpret_cast<const uint4*>(tile + th.global[i]));
#pragma unroll
  for (int i = 0; i < kTileHalvesPerThread; ++i) *reinterpret_cast<uint4*>(s + th.smem[i]) = v[i];
}

// ---------------------------------------------------------------- strips
// A strip is 4 consecutive tiles of one head: 128 padded tokens, one scale atom and, since every
// sequence starts on a 128-token boundary, always inside one sequence. The quantizer stages a
// strip's token-contiguous output in shared memory and writes 128 bytes per column (whole L2 lines).
// Measured on an H200 (bf16, 1 GiB): writing 32 bytes per column per tile ran at 55% of copy
// bandwidth, 128-byte strips at 87-90%.
inline constexpr int kStripTiles = kAtomRows / kTileTokens;  // 4
inline constexpr int kStripTokens = kAtomRows;               // 128
inline constexpr int kStripSmemWords = kStripTiles * kTileSmemWords;
// Tile k of a strip uses the tile layout with its rows XORed with k, so the 8 half-columns of one
// column (4 tiles x 2 halves, read by 8 lanes together) fall in distinct banks.
__device__ __forceinline__ int strip_word_index(int k, int d, int w) {
  return k * kTileSmemWords + (tile_word_index(d, w) ^ (k << 3));
}
__device__ __forceinline__ int strip_half_index(int k, int d, int half) {
  return k * kTileSmemWords + (tile_half_index(d, half) ^ (k << 3));
}

// Shared strip -> token-contiguous payload at `strip_dst` (= payload + h 128 P + 128 strip).
// Vector u: column u / 8, tile (u / 2) mod 4, half u mod 2: 8 lanes write one column's 128 bytes.
inline constexpr int kStripVectorsPerThread = kHeadDim * kStripTokens / 16 / kTileThreads;  // 8
__device__ __forceinline__ void strip_store_contiguous(const uint32_t* s, uint8_t* strip_dst, int64_t P) {
#pragma unroll
  for (int i = 0; i < kStripVectorsPerThread; ++i) {
    const int u = i * kTileThreads + int(threadIdx.x);
    const int d = u >> 3, k = (u >> 1) & 3, half = u & 1;
    *reinterpret_cast<uint4*>(strip_dst + d * P + kTileTokens * k + 16 * half) =
        *reinterpret_cast<const uint4*>(s + strip_half_index(k, d, half));
  }
}

// 4x4 byte transpose: in, a[r] holds columns 0..3 (byte c) of row r; out, a[c] holds rows 0..3 of
// column c. Its own inverse.
__device__ __forceinline__ void transpose4x4_bytes(uint32_t (&a)[4]) {
  const uint32_t t0 = __byte_perm(a[0], a[1], 0x5140);  // r0c0 r1c0 r0c1 r1c1
  const uint32_t t1 = __byte_perm(a[0], a[1], 0x7362);  // r0c2 r1c2 r0c3 r1c3
  const uint32_t t2 = __byte_perm(a[2], a[3], 0x5140);
  const uint32_t t3 = __byte_perm(a[2], a[3], 0x7362);
  a[0] = __byte_perm(t0, t2, 0x5410);
  a[1] = __byte_perm(t0, t2, 0x7632);
  a[2] = __byte_perm(t1, t3, 0x5410);
  a[3] = __byte_perm(t1, t3, 0x7632);
}

}  // namespace mxflash::cuda
