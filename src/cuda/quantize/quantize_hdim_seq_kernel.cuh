// hdim + seq from one read of bf16 x: a leaner kernel than quantize_kernel<uint16_t, true, kSeq, *>,
// selected by MXFLASH_QUANT_VARIANT bit 0 at run time or MXFLASH_LEAN_HDIM_SEQ=1 at build time
// (quantize_launch.cuh). Measured on an H200: the generic kernel's speed (0.83 of copy with a resident
// wave of CTAs, 0.90-0.91 with one CTA per strip, docs/performance.md): the instruction count and the
// bytes in flight were not the limit.
// Same outputs byte for byte; same tiles, strips, thread layout and shared-memory layouts as
// quantize_kernel.cuh (read that first). What changes is the instruction count per tile, which was
// suspected of holding the fused path at 0.84 of copy bandwidth while the single-orientation paths
// reached 0.90-0.92 (it was the resident wave's last round: quantize_launch.cuh).
//
// NOTES: SASS per tile (32 tokens x 128 columns; per thread: 32 elements), nvcc 13.0 sm_90a, on the
// NOTES: common path (full tile, no inf/NaN); counted by walking cuobjdump -sass of the tile loop.
// NOTES:                       old fused kernel               this kernel
// NOTES:   token-major         589 (18.4 per element)         360 (11.3 per element)
// NOTES:   token-contiguous    622 + 240 per strip = 682      397 + 94 per strip = 421 (13.2)
// NOTES:   registers           80, no spill: 6 CTAs/SM        72 (8 bytes spilled outside the tile
// NOTES:                                                      loop, reloaded once per strip): 7 CTAs/SM
// NOTES:   For comparison the single-orientation kernels (seq 342, hdim 351 per tile, 64 registers,
// NOTES:   8 CTAs/SM) run at 0.90-0.92 of copy moving 3 bytes per element (3.5-3.6 instructions per
// NOTES:   byte); this one moves 4.06 bytes per element at 2.8 (token-major) / 3.2 (token-
// NOTES:   contiguous) instructions per byte, vs 4.5 / 5.2 for the old fused kernel.
// NOTES:   Bytes in flight: one prefetched tile per CTA (8 KB) as before, 7 CTAs: up to 56 KB of
// NOTES:   loads per SM (48 KB before). At 0.9 of copy an SM must finish a tile every ~1150 cycles;
// NOTES:   360 instructions x 4 warps is ~31% of its issue slots (old: ~50% at 0.84).
// NOTES:   Prediction (1 GiB bf16, jagged:0.5:16384, 3 heads): hdim+seq token-major 0.88-0.91 of
// NOTES:   copy, token-contiguous 0.86-0.89; i.e. memory-bound like the single paths. Not measured
// NOTES:   yet (no GPU in the session that wrote it); 64 registers (8 CTAs) spills the prefetched
// NOTES:   tile's registers inside the loop, 80 (6 CTAs) costs the same instructions as 72.
//
// Where the old kernel spent its instructions, and what this one does instead:
//  - 64-bit address arithmetic per row (loads ~19 per row, stores ~6 per row and output) and per
//    scale byte (~45 for the hdim scale): here one 64-bit element offset per tile, rows one 64-bit
//    add apart, scale pointers advanced by a per-kernel step.
//  - hdim block maxima: 8 shuffles of per-row words; here the two 16-bit maxima of rows (0, 1) and
//    (2, 3) travel packed in one word, 4 shuffles.
//  - NaN patches: a branch per row and output (plus BSSY/BSYNC pairs); here one per tile. An inf or
//    NaN element makes its seq column's scale NaN, so "one of my 8 columns has scale 0xFF" covers
//    both outputs; the rare path then rewrites the non-finite elements' bytes in both.
//  - register copies of the prefetched tile (16 moves per tile): the strip's tile loop is unrolled
//    by two, the two tile buffers alternate.
//  - full tiles load without zero-filling and without per-row predicates.
//  - token-contiguous: shared-strip word addresses and the strip store's shared and global offsets
//    in closed form (the old strip store spent ~30 instructions per 16-byte vector on 64-bit index
//    arithmetic).
// The arithmetic per element is unchanged: one bf16 -> fp32 widening shared by both outputs, two
// multiplies, two halves of a paired conversion (F2FP packs two), and the |x| word shared by both
// maxima.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/quantize/mx_device.cuh"
#include "cuda/quantize/quantize_kernel.cuh"
#include "cuda/quantize/token_tile.cuh"
#include "mxflash/jagged.h"

namespace mxflash::cuda {

// scale_byte_from_amax_bits with the mode folded into two per-kernel constants:
//  RCEIL: carry kRceilMantissaCarry, at least 1 above kRceilZeroQuotientMax;
//  FLOOR: carry 0, at least 0 (the gate is never passed).
struct ScaleRule {
  uint32_t carry, gate;
  __host__ __device__ explicit ScaleRule(ScalingMode m)
      : carry(m == ScalingMode::kRceil ? kRceilMantissaCarry : 0u),
        gate(m == ScalingMode::kRceil ? kRceilZeroQuotientMax : 0xFFFFFFFFu) {}
  __host__ __device__ uint32_t byte(uint32_t amax_bits) const {
    const int e = int((amax_bits + carry) >> 23) - kFloorTargetPow2;
    const int lo = amax_bits > gate ? 1 : 0;
    const int b = e > lo ? e : lo;
    return amax_bits >= kExpAllOnes ? uint32_t(kE8m0Nan) : uint32_t(b);
  }
};

// Resident CTAs per SM the register allocation must allow: 72 registers (-Xptxas -v: 8 bytes spilled,
// stored once before the strip loop and reloaded once per strip; 8 CTAs spill inside the tile loop).
inline constexpr int kHdimSeqMinBlocks = 7;

// Two e4m3 words of 8 bf16 values (one 16-byte chunk) scaled by per-element factors.
__device__ __forceinline__ void e4m3_words(const float (&f)[8], const float (&inv)[8], uint32_t (&q)[2]) {
#pragma unroll
  for (int o = 0; o < 2; ++o)
    q[o] = e4m3x2_satfinite(f[4 * o] * inv[4 * o], f[4 * o + 1] * inv[4 * o + 1]) |
           (e4m3x2_satfinite(f[4 * o + 2] * inv[4 * o + 2], f[4 * o + 3] * inv[4 * o + 3]) << 16);
}
__device__ __forceinline__ void e4m3_words(const float (&f)[8], float inv, uint32_t (&q)[2]) {
#pragma unroll
  for (int o = 0; o < 2; ++o)
    q[o] = e4m3x2_satfinite(f[4 * o] * inv, f[4 * o + 1] * inv) |
           (e4m3x2_satfinite(f[4 * o + 2] * inv, f[4 * o + 3] * inv) << 16);
}

// Payload stores: plain, or (kStream) st.global.cs, which allocates the lines evict-first in L2.
template <bool kStream>
__device__ __forceinline__ void store_payload8(uint8_t* dst, const uint32_t (&q)[2]) {
  if constexpr (kStream)
    __stcs(reinterpret_cast<uint2*>(dst), make_uint2(q[0], q[1]));
  else
    *reinterpret_cast<uint2*>(dst) = make_uint2(q[0], q[1]);
}
template <bool kStream>
__device__ __forceinline__ void store_payload16(uint8_t* dst, const uint4& v) {
  if constexpr (kStream)
    __stcs(reinterpret_cast<uint4*>(dst), v);
  else
    *reinterpret_cast<uint4*>(dst) = v;
}

// kStageScales: blocked scale atoms staged in shared memory and written once per strip
// (store_staged_atoms, quantize_kernel.cuh); the launcher selects it only for the blocked layout
// with 16-byte aligned scale tensors. kStreamStores: payloads stored evict-first (store_payload8).
// Both are MXFLASH_QUANT_VARIANT bits (quantize_launch.cuh); the bytes written are the same.
template <bool kTokContiguous, bool kStageScales = false, bool kStreamStores = false>
__global__ void __launch_bounds__(kTileThreads, kHdimSeqMinBlocks) quantize_hdim_seq_kernel(const QuantizeParams p) {
  using M = QuantTileMap<uint16_t>;
  static_assert(M::kElems == 8 && M::kRows == 4 && M::kChunksPerRow == 16 && M::kLanesPerBlock == 4,
                "the bf16 thread layout of quantize_kernel.cuh");
  __shared__ alignas(16) uint16_t s_colmax[kTileWarps][kHeadDim];  // |bf16| bits: column maxima per warp
  __shared__ alignas(16) float s_inv[kHeadDim];                     // 1/scale of column d
  __shared__ uint32_t s_nan_columns[kTileWarps];                    // bit d mod 32 of word d / 32: NaN scale
  __shared__ alignas(16) uint32_t s_strip[kTokContiguous ? kStripSmemWords : 4];
  // Staged blocked scale atoms: [strip parity][hdim, seq].
  __shared__ alignas(16) uint32_t s_atoms[kStageScales ? 2 : 1][2][kStageScales ? kStagedAtomWords : 4];

  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int chunk = tid & 15;       // columns col0 .. col0 + 7
  const int row0 = (tid >> 4) * 4;  // rows row0 .. row0 + 3 of the tile
  const int col0 = chunk * 8;
  const int my_row = chunk & 3;  // hdim: the row (of the 4) whose block scale this lane computes
  const int hblock = chunk >> 2;
  const int64_t H = p.jd.H, P = p.jd.P;
  const int64_t row_elems = H * kHeadDim;  // elements (and payload bytes) from one token to the next
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  const ScaleRule rule(p.mode);
  const bool blocked = p.blocked;  // true whenever kStageScales (the launcher's condition)

  // Scale bytes this thread writes, relative to a strip base, and the step from tile to tile.
  //  hdim, blocked: atom + 16 r + 4 k + block; plain: (t H + h) 4 + block, t = t_first + 32 k + r.
  //  seq,  blocked: atom + 16 (d % 32) + 4 (d / 32) + k; plain: ((4 strip + k) H + h) 128 + d.
  const int hdim_r = row0 + my_row;
  const int64_t hs_thread = blocked ? int64_t(16 * hdim_r + hblock) : int64_t(hdim_r) * 4 * H + hblock;
  const int64_t hs_step = blocked ? int64_t(4) : 4 * kTileTokens * H;
  const int ss_thread = blocked ? 16 * lane + 4 * warp : tid;
  const int64_t ss_step = blocked ? int64_t(1) : kHeadDim * H;

  // Token-contiguous: byte offset in the shared strip of this thread's transposed word for columns
  // col0 + 4 cw + j, token quad row0 / 4, tile k (4 strip_word_index): with m = (chunk & 3) ^ k,
  //   (strip_word_base + 4096 k) ^ 32 (m ^ j), plus 128 cw
  // (tile_row and the k << 3 XOR only permute j; bits 5-6 of the base are zero).
  const uint32_t strip_word_base = 256 * chunk + 4 * ((row0 / 4) ^ (((chunk >> 2) & 1) << 2));
  uint8_t* const strip_bytes = reinterpret_cast<uint8_t*>(s_strip);
  // Token-contiguous strip store: this thread's 16-byte vectors (see the store after the tiles).
  const int st_d = tid >> 3, st_k = (tid >> 1) & 3, st_half = tid & 1;
  const uint32_t strip_half_base = 4 * (kTileSmemWords * st_k + 8 * (st_d ^ (st_d >> 3) ^ st_k) + 4 * st_half);
  const int64_t strip_half_dst = st_d * P + kTileTokens * st_k + 16 * st_half;

  // x of a tile into registers; `off`: element offset of this thread's first row, n: real tokens
  // from the tile's first row on (unclamped). Rows past the sequence end are zeros.
  const auto load_tile = [&](uint4(&dst)[M::kRows], int64_t off, int n) {
    const uint4* src = reinterpret_cast<const uint4*>(x + off);
    const int64_t step = row_elems / M::kElems;  // uint4 per token
    if (n >= kTileTokens) {
#pragma unroll
      for (int i = 0; i < M::kRows; ++i) dst[i] = __ldg(src + i * step);
    } else {
#pragma unroll
      for (int i = 0; i < M::kRows; ++i) {
        dst[i] = make_uint4(0, 0, 0, 0);
        if (row0 + i < n) dst[i] = __ldg(src + i * step);
      }
    }
  };

  SequenceCursor sequence(p.jd);
  TileWalker tw(blockIdx.x, gridDim.x, p.num_groups / kStripTiles, H);
  if (!tw.valid()) return;  // the whole CTA: no barrier is skipped by part of it
  SequencePos next_pos = sequence.locate(tw.g * kStripTokens);
  const int64_t tile_elems = kTileTokens * row_elems;
  // Element offset of this thread's first row in tile 0 of a strip at `pos`, head h.
  const auto strip_offset = [&](const SequencePos& pos, int64_t h) {
    return int64_t(pos.t_first + row0) * row_elems + h * kHeadDim + col0;
  };
  uint4 va[M::kRows], vb[M::kRows];
  load_tile(va, strip_offset(next_pos, tw.h), next_pos.count);

  int parity = 0;  // kStageScales: which s_atoms buffer this strip uses
  for (;;) {
    const int64_t strip = tw.g, h = tw.h;
    const SequencePos pos = next_pos;
    TileWalker following = tw;
    following.next();
    const int64_t atom = blocked_atom_base(h, strip * kStripTiles, P);
    const int64_t x_strip = strip_offset(pos, h);
    // Staged: the strip's atoms in shared memory, at the same offsets.
    uint8_t* const hs_strip =
        kStageScales ? reinterpret_cast<uint8_t*>(s_atoms[kStageScales ? parity : 0][0]) + hs_thread
                     : p.hdim_scales + (blocked ? atom : (int64_t(pos.t_first) * H + h) * 4) + hs_thread;
    uint8_t* const ss_strip =
        kStageScales ? reinterpret_cast<uint8_t*>(s_atoms[kStageScales ? parity : 0][1]) + ss_thread
                     : p.tok_scales + (blocked ? atom : (strip * kStripTiles * H + h) * kHeadDim) + ss_thread;

    // Tile k of the strip, its x in v. off: element offset of this thread's first row; hs, ss: its
    // scale bytes; rest: real tokens from the tile's first row on (unclamped).
    const auto process = [&](const uint4(&v)[M::kRows], int k, int64_t off, uint8_t* hs, uint8_t* ss, int rest) {
      uint32_t* const tile = s_strip + k * kTileSmemWords;
      if (rest <= 0) {
        // No real token (a strip's tail in a short sequence): the bytes the full path writes for
        // zeros. rest is the same in the whole CTA: no barrier is skipped by part of it.
        if (blocked) *hs = 0;  // (row, block) pairs of all 128 threads cover the 32 x 4 bytes
        *ss = 0;
        if constexpr (kTokContiguous) {
          static_assert(kTileSmemWords == 8 * kTileThreads, "two 16-byte zero stores per thread");
          reinterpret_cast<uint4*>(tile)[tid] = make_uint4(0, 0, 0, 0);
          reinterpret_cast<uint4*>(tile)[tid + kTileThreads] = make_uint4(0, 0, 0, 0);
        }
        return;
      }
      const int valid_rows = rest - row0;  // rows i < valid_rows of this thread are real tokens

      // |x| words, shared by both maxima.
      uint32_t a[M::kRows][4];
#pragma unroll
      for (int i = 0; i < M::kRows; ++i) {
        a[i][0] = v[i].x & kBf16AbsMask2;
        a[i][1] = v[i].y & kBf16AbsMask2;
        a[i][2] = v[i].z & kBf16AbsMask2;
        a[i][3] = v[i].w & kBf16AbsMask2;
      }

      // seq: column maxima of this thread's 4 rows, of the warp's 8 rows (lanes l, l ^ 16 share
      // columns), to shared memory.
      uint32_t cm[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) cm[c] = __vmaxu2(__vmaxu2(a[0][c], a[1][c]), __vmaxu2(a[2][c], a[3][c]));
#pragma unroll
      for (int c = 0; c < 4; ++c) cm[c] = __vmaxu2(cm[c], __shfl_xor_sync(~0u, cm[c], 16));
      if (lane < 16) *reinterpret_cast<uint4*>(&s_colmax[warp][col0]) = make_uint4(cm[0], cm[1], cm[2], cm[3]);

      // hdim: per row the 16-bit maxima of even and odd columns; rows (0, 1) and (2, 3) packed
      // as 16-bit halves of one word each, reduced over the block's 4 lanes.
      uint32_t rm[M::kRows];
#pragma unroll
      for (int i = 0; i < M::kRows; ++i) rm[i] = __vmaxu2(__vmaxu2(a[i][0], a[i][1]), __vmaxu2(a[i][2], a[i][3]));
      uint32_t r01 = __vmaxu2(__byte_perm(rm[0], rm[1], 0x5410), __byte_perm(rm[0], rm[1], 0x7632));
      uint32_t r23 = __vmaxu2(__byte_perm(rm[2], rm[3], 0x5410), __byte_perm(rm[2], rm[3], 0x7632));
#pragma unroll
      for (int o = 1; o < M::kLanesPerBlock; o <<= 1) {
        r01 = __vmaxu2(r01, __shfl_xor_sync(~0u, r01, o));
        r23 = __vmaxu2(r23, __shfl_xor_sync(~0u, r23, o));
      }
      const uint32_t mine = my_row < 2 ? r01 : r23;
      const uint32_t hdim_amax = (my_row & 1) ? (mine & 0xFFFF0000u) : (mine << 16);
      const uint32_t hdim_scale = rule.byte(hdim_amax);
      // Blocked: padding rows too (their zero data gives scale 0).
      if (blocked || my_row < valid_rows) *hs = uint8_t(hdim_scale);
      const float hdim_my_inv = e8m0_inv_scale(uint8_t(hdim_scale));
      float hinv[M::kRows];
#pragma unroll
      for (int i = 0; i < M::kRows; ++i) hinv[i] = __shfl_sync(~0u, hdim_my_inv, (lane & ~3) | i);

      __syncthreads();
      {
        // seq scale of column d = tid.
        const uint32_t m = max(max(uint32_t(s_colmax[0][tid]), uint32_t(s_colmax[1][tid])),
                               max(uint32_t(s_colmax[2][tid]), uint32_t(s_colmax[3][tid])));
        const uint32_t s = rule.byte(m << 16);
        s_inv[tid] = e8m0_inv_scale(uint8_t(s));
        const uint32_t nan_columns = __ballot_sync(~0u, s == kE8m0Nan);
        if (lane == 0) s_nan_columns[warp] = nan_columns;
        *ss = uint8_t(s);
      }
      __syncthreads();
      float sinv[M::kElems];
      {
        const float4 f0 = *reinterpret_cast<const float4*>(&s_inv[col0]);
        const float4 f1 = *reinterpret_cast<const float4*>(&s_inv[col0 + 4]);
        sinv[0] = f0.x, sinv[1] = f0.y, sinv[2] = f0.z, sinv[3] = f0.w;
        sinv[4] = f1.x, sinv[5] = f1.y, sinv[6] = f1.z, sinv[7] = f1.w;
      }
      // Any inf/NaN element of this thread's chunk rows makes its column's scale NaN.
      const bool any_nan = ((s_nan_columns[col0 / 32] >> (col0 % 32)) & 0xFFu) != 0;

      // Both payloads, one widening per element.
      uint8_t* hp = p.hdim_payload + off;
      uint8_t* tp = p.tok_payload + off;
      uint32_t qs[M::kRows][2];
#pragma unroll
      for (int i = 0; i < M::kRows; ++i) {
        const uint32_t w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
        float f[8];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          f[2 * c] = __uint_as_float(w[c] << 16);
          f[2 * c + 1] = __uint_as_float(w[c] & 0xFFFF0000u);
        }
        uint32_t qh[2];
        e4m3_words(f, hinv[i], qh);
        e4m3_words(f, sinv, qs[i]);
        if (i < valid_rows) {
          store_payload8<kStreamStores>(hp, qh);
          if constexpr (!kTokContiguous) store_payload8<kStreamStores>(tp, qs[i]);
        }
        hp += row_elems;
        if constexpr (!kTokContiguous) tp += row_elems;
      }
      if constexpr (kTokContiguous) {
        // Transpose 4 tokens x 4 columns at a time into tile k of the shared strip.
        const uint32_t base = (strip_word_base + 4 * kTileSmemWords * k) ^ (32 * ((chunk & 3) ^ k));
#pragma unroll
        for (int cw = 0; cw < 2; ++cw) {
          uint32_t t[4] = {qs[0][cw], qs[1][cw], qs[2][cw], qs[3][cw]};
          transpose4x4_bytes(t);
#pragma unroll
          for (int j = 0; j < 4; ++j) *reinterpret_cast<uint32_t*>(strip_bytes + ((base ^ (32 * j)) + 128 * cw)) = t[j];
        }
      }
      if (any_nan) {
        // Rare: rewrite the bytes of the non-finite elements (padding rows are zeros) in both
        // payloads; this thread wrote them, so program order makes the rewrite win.
#pragma unroll 1
        for (int i = 0; i < valid_rows && i < M::kRows; ++i) {
          const int64_t o = off + i * row_elems;
          const int r = row0 + i;
#pragma unroll 1
          for (int e = 0; e < M::kElems; ++e) {
            const uint32_t u = uint32_t(x[o + e]) << 16;
            if ((u & kExpAllOnes) != kExpAllOnes) continue;
            const uint8_t b = uint8_t(e4m3_nonfinite_byte(u));
            p.hdim_payload[o + e] = b;
            if constexpr (kTokContiguous)
              strip_bytes[4 * strip_word_index(k, col0 + e, r / 4) + r % 4] = b;
            else
              p.tok_payload[o + e] = b;
          }
        }
      }
    };

    // Tiles 0..3, the loads of the next one (or of the next strip's tile 0) issued first. The
    // per-tile offsets advance by one add each.
    int64_t off = x_strip;
    uint8_t* hs = hs_strip;
    uint8_t* ss = ss_strip;
    int rest = pos.count;
#pragma unroll 1
    for (int k = 0; k < kStripTiles; k += 2) {
      load_tile(vb, off + tile_elems, rest - kTileTokens);
      process(va, k, off, hs, ss, rest);
      off += tile_elems, hs += hs_step, ss += ss_step, rest -= kTileTokens;
      if (k + 2 < kStripTiles) {
        load_tile(va, off + tile_elems, rest - kTileTokens);
      } else if (following.valid()) {
        next_pos = sequence.locate(following.g * kStripTokens);
        load_tile(va, strip_offset(next_pos, following.h), next_pos.count);
      }
      process(vb, k + 1, off, hs, ss, rest);
      off += tile_elems, hs += hs_step, ss += ss_step, rest -= kTileTokens;
    }

    if constexpr (kTokContiguous || kStageScales) __syncthreads();
    if constexpr (kTokContiguous) {
      // The strip to the payload, as strip_store_contiguous (vector u = 128 i + tid: column u / 8,
      // tile (u / 2) mod 4, half u mod 2) with the indices in closed form: global offset
      // strip_dst + (tid / 8) P + 32 ((tid / 2) mod 4) + 16 (tid mod 2) + 16 P i; shared byte
      // offset strip_half_base ^ {0, 64, 16, 80}[i mod 4], plus 512 i.
      uint8_t* dst = p.tok_payload + h * kHeadDim * P + strip * kStripTokens + strip_half_dst;
#pragma unroll
      for (int i = 0; i < kStripVectorsPerThread; ++i) {
        constexpr uint32_t kXor[4] = {0, 64, 16, 80};
        store_payload16<kStreamStores>(
            dst, *reinterpret_cast<const uint4*>(strip_bytes + ((strip_half_base ^ kXor[i % 4]) + 512 * i)));
        dst += 16 * P;
      }
    }
    if constexpr (kStageScales) {
      store_staged_atoms(s_atoms[parity][0], s_atoms[parity][1], p.hdim_scales + atom, p.tok_scales + atom);
      parity ^= 1;
    }
    if (!following.valid()) break;
    tw = following;
  }
}

}  // namespace mxflash::cuda
