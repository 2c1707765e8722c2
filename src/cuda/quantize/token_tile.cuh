// The unit of work of every quantization kernel: a tile of 32 padded tokens (one MX block along the
// sequence) x 128 head-dim columns of one head. Tiles walk the padded token axis (P/32 groups per
// head), so every padding byte of a P-indexed output (blocked scales, seq/square32 scales,
// token-contiguous payloads) belongs to exactly one tile and is written in the same pass.
#pragma once
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

// Sequence of a padded token, for a walk whose group index never decreases (TileWalker). It keeps
// the current sequence and gallops forward from it: tiles inside one long sequence cost no memory
// access, and a jump over k sequences O(log k) probes (a binary search from scratch costs
// O(log B) dependent loads per tile). The sequence holding padded token tp is the last b with
// cu_seqlens_sf[b] <= tp (an empty sequence shares its start with the next one, so the last match
// skips it).
class SequenceCursor {
 public:
  __device__ explicit SequenceCursor(const JaggedDevice& d) : d_(d) { load(0); }

  __device__ GroupSpan span(int64_t g) {
    const int tp = int(g * kTileTokens);  // P fits in int32 (JaggedMeta checks it)
    if (tp >= sf_end_) seek(tp);
    const int offset = tp - sf_begin_;
    const int n = len_ - offset;
    return GroupSpan{t_begin_ + offset, n < 0 ? 0 : (n > kTileTokens ? kTileTokens : n)};
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
    int lo = b_ + 1, hi = d_.batch;  // cu_sf[lo] <= tp < cu_sf[hi]
    for (int step = 1; lo + step < hi; step *= 2) {
      if (__ldg(d_.cu_seqlens_sf + lo + step) > tp) {
        hi = lo + step;
        break;
      }
      lo += step;
    }
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

// Grid-stride walk over tiles (g, h), h fastest so that concurrently running CTAs read adjacent
// memory. Keeps (g, h) incrementally: one 64-bit division per thread instead of one per tile.
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
// writes 2-way (bf16 thread layout) or 4-way (fp32) conflicted; a swizzle inside the halves could
// remove those, but readers would pay 8 selects per half to restore the order: issue slots are
// the scarcer resource here (measured by bank simulation, see the report of the change).
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
  for (int i = 0; i < kTileHalvesPerThread; ++i) v[i] = __ldcs(reinterpret_cast<const uint4*>(tile + th.global[i]));
#pragma unroll
  for (int i = 0; i < kTileHalvesPerThread; ++i) *reinterpret_cast<uint4*>(s + th.smem[i]) = v[i];
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
