// The forward's operands in the main kernel's execution layout, written from the unquantized Q, K, V
// in one pass each (no MX tensor in between, no prepare pass): every element is quantized to MX
// exactly as the quantizer does (RCEIL, 32-blocks, hardware e4m3 conversion, non-finite patching)
// and its byte then re-expressed to the coarser power-of-two scale of its group, exactly as the
// prepare pass does (shift_e4m3x4):
//   Q: per (head, row); K: per (head, 128-key tile)  -> prepare_rows_kernel with XRowSource;
//   V: per (head, 128-key tile)                      -> operand_v_kernel.
// A group never spans more than one 128-token strip, the unit each CTA reads once. The bytes equal
// ref::attention_fwd_operands (the CPU: the MX quantizer, then the same re-expression).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/attention/attention_bwd.h"
#include "cuda/attention/attention_fwd.h"
#include "cuda/attention/attention_fwd_prepare.cuh"
#include "cuda/common/launch_utils.cuh"
#include "cuda/quantize/quantize_kernel.cuh"

namespace mxflash::cuda {
namespace attn {
namespace {

// 16 elements of a row (half of the 32-block chunk / 2; the other half is in the neighbouring lane)
// quantized to MX bytes, and the block's scale byte; `row` points at the 16 (global or shared).
template <typename In>
__device__ __forceinline__ void quantize_row_half(bool valid, const In* row, uint4* words, int* s) {
  constexpr int kLoads = int(16 * sizeof(In) / sizeof(uint4));  // 2 (bf16) or 4 (fp32)
  using Map = QuantTileMap<In>;
  uint4 v[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) v[i] = valid ? reinterpret_cast<const uint4*>(row)[i] : make_uint4(0, 0, 0, 0);
  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < kLoads; ++i) amax = max(amax, chunk_amax_bits<In>(v[i]));
  amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));  // the block's other 16 elements
  const uint32_t sb = scale_byte_from_amax_bits(amax, ScalingMode::kRceil);
  float inv[Map::kElems];
#pragma unroll
  for (int e = 0; e < Map::kElems; ++e) inv[e] = e8m0_inv_scale(uint8_t(sb));
  uint32_t q[4];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    uint32_t part[Map::kOutWords];
    quantize_chunk<In>(v[i], inv, part);
#pragma unroll
    for (int o = 0; o < Map::kOutWords; ++o) q[i * Map::kOutWords + o] = part[o];
  }
  if (sb == kE8m0Nan) {  // rare: inf / NaN elements (only in such blocks) get the quantizer's bytes
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const uint32_t u = x_bits<In>(row, e);
      if ((u & kExpAllOnes) == kExpAllOnes)
        q[e / 4] = (q[e / 4] & ~(0xFFu << (8 * (e % 4)))) | (e4m3_nonfinite_byte(u) << (8 * (e % 4)));
    }
  }
  *words = make_uint4(q[0], q[1], q[2], q[3]);
  *s = int(sb);
}

// prepare_rows_kernel's source: x (T, H, 128) in global memory.
template <typename In>
struct XRowSource {
  const In* x;
  int64_t H;
  __device__ __forceinline__ void operator()(bool valid, int64_t t, int64_t, int64_t h, int chunk, uint4* words,
                                             int* s) const {
    quantize_row_half<In>(valid, x + (t * H + h) * kHeadDim + chunk * 16, words, s);
  }
};

// rows_tile's source inside operand_v_kernel<..., kRows>: the tile's 128 token rows, staged in
// shared memory (row r = padded token tile0 + r; rows past the sequence's end hold zeros).
template <typename In>
struct StagedRowSource {
  const In (*rows)[kHeadDim];
  int64_t tile0;
  __device__ __forceinline__ void operator()(bool valid, int64_t, int64_t tp, int64_t, int chunk, uint4* words,
                                             int* s) const {
    quantize_row_half<In>(valid, &rows[tp - tile0][chunk * 16], words, s);
  }
};

// V: one CTA of 256 threads per (128-token tile, head). The tile's token rows are staged in shared
// memory, 32 KB at a time (all 128 tokens of bf16, two halves of fp32), loaded whole with 16-byte
// lanes. Each thread quantizes two MX blocks (a channel over the 32 tokens of a group): for bf16 the
// channel pair 2 cp, 2 cp + 1 of group g (a warp reads 64 consecutive channels, one whole 128-byte
// row, per step), for fp32 channel d of groups gh and gh + 2 (32 channels per step). Each group's 32
// bytes leave re-expressed and permuted (permuted_token) as 32 contiguous bytes of V' row d. The
// tile's scale is the largest finite block scale of the tile (all channels; a CTA-wide max); a
// block whose scale is NaN (an inf or NaN element) becomes 32 NaN bytes, so only its channel turns
// NaN, as in exact MX. Tokens past the sequence end are zeros; tile_scale gets e8m0 of the tile
// scale.
inline constexpr int kOperandVThreads = 256;
// Word w of group g of a V' row whose block scale is NaN: e4m3 NaN for the sequence's tokens,
// zero for the padding past its end.
__device__ __forceinline__ uint32_t nan_word(int g, int w, int valid_tokens) {
  const int t0 = g * kBlockSize + v_word_base(w);  // the word's tokens: t0 + {0, 1, 8, 9}
  uint32_t word = 0;
#pragma unroll
  for (int b = 0; b < 4; ++b)
    if (t0 + (b % 2) + 8 * (b / 2) < valid_tokens) word |= 0x7Fu << (8 * b);
  return word;
}
//
// kRows (bf16 only: the whole tile is staged at once): the same pass also writes x along the head
// dim from the staged rows, as prepare_rows_kernel<kRows == kRowsPerRow> with XRowSource would
// (rows_tile; one scale per row or per tile, into row_out / row_scale), so that one read of x
// serves a token-contiguous and a row operand (quantize_attention_training).
//
// kMxIn (bf16 only): x is an MX tensor instead, payload bytes (T, H, 128) at x with plain hdim scales
// (T, H, 4) at x_scales; the staged rows are its values widened to bf16 (dequantize8: the bytes of
// dequantize(..., bf16)), so the outputs equal this kernel's on that bf16 tensor, from half the reads.
inline constexpr int kRowsNone = 0, kRowsPerRow = 1, kRowsPerTile = 2;
template <typename In, int kRows = kRowsNone, bool kMxIn = false>
__global__ void __launch_bounds__(kOperandVThreads, 3) operand_v_kernel(const In* __restrict__ x,
                                                                        const int32_t* __restrict__ cu,
                                                                        const int32_t* __restrict__ cu_sf, int batch,
                                                                        int64_t H, int64_t P, uint8_t* __restrict__ out,
                                                                        float* __restrict__ tile_scale,
                                                                        uint8_t* __restrict__ row_out = nullptr,
                                                                        float* __restrict__ row_scale = nullptr,
                                                                        const uint8_t* __restrict__ x_scales = nullptr) {
  static_assert(!kMxIn || sizeof(In) == 2, "MX sources are staged as bf16");
  constexpr int kStageTokens = 32768 / (kHeadDim * int(sizeof(In)));  // 128 (bf16) or 64 (fp32)
  constexpr int kStages = kTile / kStageTokens;
  constexpr int kChunks = kHeadDim * int(sizeof(In)) / 16;          // 16-byte chunks per token row
  static_assert(kRows == kRowsNone || kStages == 1, "row outputs need the whole tile staged (bf16)");
  static_assert(kRowThreads == kOperandVThreads, "rows_tile runs on this CTA");
  __shared__ alignas(16) In rows[kStageTokens][kHeadDim];
  __shared__ int warp_max[kOperandVThreads / 32];
  const int64_t tile = blockIdx.x, h = blockIdx.y;
  const int b = sequence_of_padded_warp(cu_sf, batch, tile * kTile);
  const int64_t len = int64_t(cu[b + 1]) - cu[b];
  const int64_t first = tile * kTile - cu_sf[b];
  const int64_t rem = len - first;
  const int valid_tokens = rem <= 0 ? 0 : (rem >= kTile ? kTile : int(rem));
  // Each thread quantizes two (channel, 32-token group) blocks, its units u = 0, 1: bf16 (one stage)
  // channels 2 cp + u of group g, read as one bf16 pair per token (a warp reads whole 128-byte rows);
  // fp32 (two stages of 64 tokens) channel d of groups gh and gh + 2, one per stage.
  constexpr bool kPairs = sizeof(In) == 2;
  const int tid = int(threadIdx.x);
  const int cp = tid % (kHeadDim / 2), g = tid / (kHeadDim / 2);  // kPairs
  const int d = tid % kHeadDim, gh = tid / kHeadDim;              // fp32
  auto channel = [&](int u) { return kPairs ? 2 * cp + u : d; };
  auto group = [&](int u) { return kPairs ? g : 2 * u + gh; };
  uint32_t q[2][kBlockSize / 4];  // per unit: 8 words, tokens 4w..4w+3 of its group
  uint32_t sb[2];
  // The quantizer's bytes for the block of unit u from its 32 values (fp32 bits, elem(i)); the
  // rare inf / NaN elements re-read from shared memory at col_addr + i * kHeadDim * sizeof(In).
  auto quantize_unit = [&](int u, auto elem, uint32_t amax, uint32_t col_addr) {
    sb[u] = scale_byte_from_amax_bits(amax, ScalingMode::kRceil);
    const float inv = e8m0_inv_scale(uint8_t(sb[u]));
#pragma unroll
    for (int w = 0; w < kBlockSize / 4; ++w) {
      const uint32_t lo = e4m3x2_satfinite(__uint_as_float(elem(4 * w)) * inv, __uint_as_float(elem(4 * w + 1)) * inv);
      const uint32_t hi =
          e4m3x2_satfinite(__uint_as_float(elem(4 * w + 2)) * inv, __uint_as_float(elem(4 * w + 3)) * inv);
      q[u][w] = lo | (hi << 16);
    }
    if (sb[u] == kE8m0Nan) {  // rare: inf / NaN elements get the quantizer's bytes
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i) {  // unrolled: static indices keep q in registers
        // re-read (volatile): keeping the 32 values live for this path would cost registers
        const uint32_t addr = col_addr + uint32_t(i * kHeadDim * int(sizeof(In)));
        uint32_t v;
        if constexpr (kPairs) {
          uint16_t v16;
          asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v16) : "r"(addr));
          v = uint32_t(v16) << 16;
        } else {
          asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
        }
        const int sh = 8 * (i % 4);
        if ((v & kExpAllOnes) == kExpAllOnes) q[u][i / 4] = (q[u][i / 4] & ~(0xFFu << sh)) | (e4m3_nonfinite_byte(v) << sh);
      }
    }
  };
#pragma unroll
  for (int stage = 0; stage < kStages; ++stage) {
    if (stage > 0) __syncthreads();  // the previous stage's rows are read
    {
      // Thread = (row r0 + kRowStep k, 16-byte chunk c): a fixed trip count and one pointer step per
      // load (a loop from tid with 64-bit index math per load cost ~25 instructions each).
      static_assert(kStageTokens * kChunks % kOperandVThreads == 0 && kOperandVThreads % kChunks == 0);
      constexpr int kRowStep = kOperandVThreads / kChunks;
      const int c = tid % kChunks, r0 = tid / kChunks;
      const int64_t elem0 = ((cu[b] + first + stage * kStageTokens + r0) * H + h) * kHeadDim + c * (16 / sizeof(In));
      const int64_t step = int64_t(kRowStep) * H * kHeadDim;
      constexpr int kLoads = kStageTokens * kChunks / kOperandVThreads;
      if constexpr (kMxIn) {
        // 8 e4m3 bytes at element elem0 + k step and their block's scale byte, all loaded before
        // any is widened (a load per widening held each thread to one load in flight: 1.5x the time)
        uint2 qw[kLoads];
        uint32_t sc[kLoads];
#pragma unroll
        for (int k = 0; k < kLoads; ++k) {
          qw[k] = make_uint2(0, 0), sc[k] = 127;  // past the sequence's end: zeros
          if (stage * kStageTokens + r0 + k * kRowStep < valid_tokens) {
            const int64_t e = elem0 + k * step;
            qw[k] = __ldg(reinterpret_cast<const uint2*>(reinterpret_cast<const uint8_t*>(x) + e));
            sc[k] = __ldg(x_scales + e / kBlockSize);
          }
        }
#pragma unroll
        for (int k = 0; k < kLoads; ++k)
          *reinterpret_cast<uint4*>(&rows[r0 + k * kRowStep][c * (16 / sizeof(In))]) =
              dequantize8_bf16(qw[k].x, qw[k].y, sc[k]);
      } else {
        const In* src = x + elem0;
#pragma unroll
        for (int k = 0; k < kLoads; ++k) {
          const int r = r0 + k * kRowStep;
          uint4 v = make_uint4(0, 0, 0, 0);
          if (stage * kStageTokens + r < valid_tokens) v = *reinterpret_cast<const uint4*>(src + k * step);
          *reinterpret_cast<uint4*>(&rows[r][c * (16 / sizeof(In))]) = v;
        }
      }
    }
    __syncthreads();
    if constexpr (kPairs) {
      const uint32_t* col = reinterpret_cast<const uint32_t*>(&rows[g * kBlockSize][2 * cp]);
      uint32_t pair[kBlockSize];  // channels 2 cp, 2 cp + 1 of token i: read once
      uint32_t amax[2] = {0, 0};
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i) {
        pair[i] = col[i * (kHeadDim / 2)];
        amax[0] = max(amax[0], (pair[i] << 16) & kAbsMask);
        amax[1] = max(amax[1], pair[i] & (kAbsMask & 0xFFFF0000u));
      }
      const uint32_t addr = uint32_t(__cvta_generic_to_shared(col));
      quantize_unit(0, [&](int i) { return pair[i] << 16; }, amax[0], addr);
      quantize_unit(1, [&](int i) { return pair[i] & 0xFFFF0000u; }, amax[1], addr + 2);
    } else {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if ((2 * u * kBlockSize) / kStageTokens != stage) continue;  // group 2u + gh lies in another stage
        const In* col = &rows[group(u) * kBlockSize - stage * kStageTokens][d];
        auto elem = [&](int i) { return __float_as_uint(float(col[i * kHeadDim])); };
        uint32_t amax = 0;
#pragma unroll
        for (int i = 0; i < kBlockSize; ++i) amax = max(amax, elem(i) & kAbsMask);
        quantize_unit(u, elem, amax, uint32_t(__cvta_generic_to_shared(col)));
      }
    }
  }
  if constexpr (kRows != kRowsNone) {
    // The staged rows are complete (one stage) and only read here; rows_tile's own CTA-wide max
    // (per tile) uses warp_max and is done with it before the tile maximum below writes it.
    rows_tile<kRows == kRowsPerRow>(StagedRowSource<In>{rows, tile * kTile}, cu, cu_sf, batch, P, row_out, row_scale,
                                    warp_max, tile, h);
    if constexpr (kRows == kRowsPerTile) __syncthreads();
  }
  int tile_max = 0;
#pragma unroll
  for (int u = 0; u < 2; ++u)
    if (sb[u] != kE8m0Nan) tile_max = max(tile_max, int(sb[u]));
  tile_max = __reduce_max_sync(0xFFFFFFFFu, tile_max);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = tile_max;
  __syncthreads();  // also: every thread is done reading the staged rows
#pragma unroll
  for (int w = 0; w < kOperandVThreads / 32; ++w) tile_max = max(tile_max, warp_max[w]);
  // The tile's V' rows go through shared memory (over the staged input, read by now), so that they
  // leave as whole 128-byte rows: lanes storing 16 bytes each into 32 different rows would make
  // every 32-byte sector two L2 writes.
  static_assert(sizeof(rows) >= sizeof(uint32_t) * kHeadDim * kVRowPitch, "the V' tile fits the staging rows");
  uint32_t(*vrows)[kVRowPitch] = reinterpret_cast<uint32_t(*)[kVRowPitch]>(&rows[0][0]);
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int w = 0; w < 8; ++w)
      vrows[channel(u)][group(u) * 8 + w] =
          sb[u] == kE8m0Nan ? nan_word(group(u), w, valid_tokens) : permuted_word(q[u], w, tile_max - int(sb[u]));
  __syncthreads();
  store_v_rows<kOperandVThreads>(vrows, out + h * kHeadDim * P + tile * kTile, P);
  if (threadIdx.x == 0) tile_scale[h * (P / kTile) + tile] = e8m0_to_float(uint8_t(tile_max));
}

// One side's sequences (Q's or K/V's) as the operand kernels take them.
struct Side {
  const int32_t *cu, *cu_sf;
  int batch;  // sequences
  int64_t P;  // padded tokens
};
template <typename Problem>
Side q_side(const Problem& p) {
  return {p.cu_q, p.cu_q_sf, p.broadcast_q ? 1 : p.batch, p.Pq};
}
template <typename Problem>
Side k_side(const Problem& p) {
  return {p.cu_k, p.cu_k_sf, p.batch, p.Pk};
}

// x (T, H, 128) in rows (H, P, 128): one scale per row (kPerRow) or per 128-token tile.
template <bool kPerRow, typename In>
Status launch_rows(const In* x, int64_t H, const Side& sd, uint8_t* out, float* scale, cudaStream_t stream,
                   const char* what) {
  if (sd.P == 0) return Status::Ok();
  prepare_rows_kernel<kPerRow><<<dim3(unsigned(sd.P / kTile), unsigned(H)), kRowThreads, 0, stream>>>(
      XRowSource<In>{x, H}, sd.cu, sd.cu_sf, sd.batch, sd.P, out, scale);
  return cuda_error(cudaGetLastError(), what);
}

// x (T, H, 128) token-contiguous (H, 128, P) in the fragment order, one scale per 128-token tile.
template <typename In>
Status launch_tokens(const In* x, int64_t H, const Side& sd, uint8_t* out, float* scale, cudaStream_t stream,
                     const char* what) {
  if (sd.P == 0) return Status::Ok();
  operand_v_kernel<In><<<dim3(unsigned(sd.P / kTile), unsigned(H)), kOperandVThreads, 0, stream>>>(
      x, sd.cu, sd.cu_sf, sd.batch, H, sd.P, out, scale);
  return cuda_error(cudaGetLastError(), what);
}

// Both of launch_tokens (into tok, tok_scale) and launch_rows<kPerRow> (into row, row_scale) from
// one read of x: one fused kernel for bf16, the two kernels for fp32 (the same bytes either way).
template <bool kPerRow, typename In>
Status launch_tokens_and_rows(const In* x, int64_t H, const Side& sd, uint8_t* tok, float* tok_scale, uint8_t* row,
                              float* row_scale, cudaStream_t stream, const char* what) {
  if constexpr (sizeof(In) == 4) {
    MXFLASH_RETURN_IF_ERROR(launch_tokens(x, H, sd, tok, tok_scale, stream, what));
    return launch_rows<kPerRow>(x, H, sd, row, row_scale, stream, what);
  } else {
    if (sd.P == 0) return Status::Ok();
    operand_v_kernel<In, kPerRow ? kRowsPerRow : kRowsPerTile>
        <<<dim3(unsigned(sd.P / kTile), unsigned(H)), kOperandVThreads, 0, stream>>>(
            x, sd.cu, sd.cu_sf, sd.batch, H, sd.P, tok, tok_scale, row, row_scale);
    return cuda_error(cudaGetLastError(), what);
  }
}

// launch_tokens_and_rows<kPerRow> for an MX x (payload, plain hdim scales; see operand_v_kernel).
template <bool kPerRow>
Status launch_tokens_and_rows_mx(const uint8_t* x, const uint8_t* x_scales, int64_t H, const Side& sd, uint8_t* tok,
                                 float* tok_scale, uint8_t* row, float* row_scale, cudaStream_t stream,
                                 const char* what) {
  if (sd.P == 0) return Status::Ok();
  operand_v_kernel<uint16_t, kPerRow ? kRowsPerRow : kRowsPerTile, true>
      <<<dim3(unsigned(sd.P / kTile), unsigned(H)), kOperandVThreads, 0, stream>>>(
          reinterpret_cast<const uint16_t*>(x), sd.cu, sd.cu_sf, sd.batch, H, sd.P, tok, tok_scale, row, row_scale,
          x_scales);
  return cuda_error(cudaGetLastError(), what);
}

template <typename In>
Status launch_operands(const AttentionFwdProblem& p, const In* q, const In* k, const In* v, const FwdExecOperands& out,
                       cudaStream_t stream) {
  const int64_t H = p.heads, Hkv = kv_heads_of(p);  // (Hkv: K and V's heads)
  MXFLASH_RETURN_IF_ERROR(
      launch_rows<true>(q, H, q_side(p), out.q, out.q_scale, stream, "quantize_attention_forward: Q launch"));
  MXFLASH_RETURN_IF_ERROR(
      launch_rows<false>(k, Hkv, k_side(p), out.k, out.k_scale, stream, "quantize_attention_forward: K launch"));
  return launch_tokens(v, Hkv, k_side(p), out.v, out.v_scale, stream, "quantize_attention_forward: V launch");
}

// The backward's operands: Q' per row, K' and V rows per 128-key tile (the rows kernel), Qᵀ' and
// Kᵀ' token-contiguous per 128-token tile (operand_v_kernel, as V' of the forward).
template <typename In>
Status launch_bwd_operands(const AttentionBwdProblem& p, const In* q, const In* k, const In* v,
                           const BwdExecOperands& out, bool write_qk, cudaStream_t stream) {
  const int64_t H = p.heads, Hkv = kv_heads_of(p);  // (Hkv: K and V's heads)
  if (write_qk) {
    MXFLASH_RETURN_IF_ERROR(
        launch_rows<true>(q, H, q_side(p), out.q, out.q_scale, stream, "quantize_attention_backward: Q launch"));
    MXFLASH_RETURN_IF_ERROR(
        launch_rows<false>(k, Hkv, k_side(p), out.k, out.k_scale, stream, "quantize_attention_backward: K launch"));
  }
  MXFLASH_RETURN_IF_ERROR(
      launch_rows<false>(v, Hkv, k_side(p), out.v, out.v_scale, stream, "quantize_attention_backward: V launch"));
  MXFLASH_RETURN_IF_ERROR(launch_tokens(q, H, q_side(p), out.qt, out.qt_scale, stream,
                                        "quantize_attention_backward: Q along tokens launch"));
  return launch_tokens(k, Hkv, k_side(p), out.kt, out.kt_scale, stream,
                       "quantize_attention_backward: K along tokens launch");
}

// The forward's operands and the backward's (but its Q' and K', which are the forward's) from one
// read of each input: Q -> Q' and Qᵀ', K -> K' and Kᵀ', V -> V' and V rows.
template <typename In>
Status launch_training_operands(const AttentionFwdProblem& p, const In* q, const In* k, const In* v,
                                const FwdExecOperands& fwd, const BwdExecOperands& bwd, cudaStream_t stream) {
  const int64_t H = p.heads, Hkv = kv_heads_of(p);  // (Hkv: K and V's heads)
  MXFLASH_RETURN_IF_ERROR(launch_tokens_and_rows<true>(q, H, q_side(p), bwd.qt, bwd.qt_scale, fwd.q, fwd.q_scale,
                                                       stream, "quantize_attention_training: Q launch"));
  MXFLASH_RETURN_IF_ERROR(launch_tokens_and_rows<false>(k, Hkv, k_side(p), bwd.kt, bwd.kt_scale, fwd.k, fwd.k_scale,
                                                        stream, "quantize_attention_training: K launch"));
  return launch_tokens_and_rows<false>(v, Hkv, k_side(p), fwd.v, fwd.v_scale, bwd.v, bwd.v_scale, stream,
                                       "quantize_attention_training: V launch");
}

// launch_training_operands with K and V given as MX tensors.
template <typename In>
Status launch_training_operands_mx_kv(const AttentionFwdProblem& p, const In* q, const MxKvSource& kv,
                                      const FwdExecOperands& fwd, const BwdExecOperands& bwd, cudaStream_t stream) {
  const int64_t H = p.heads, Hkv = kv_heads_of(p);  // (Hkv: K and V's heads)
  MXFLASH_RETURN_IF_ERROR(launch_tokens_and_rows<true>(q, H, q_side(p), bwd.qt, bwd.qt_scale, fwd.q, fwd.q_scale,
                                                       stream, "quantize_attention_training: Q launch"));
  MXFLASH_RETURN_IF_ERROR(launch_tokens_and_rows_mx<false>(kv.k, kv.k_scales, Hkv, k_side(p), bwd.kt, bwd.kt_scale,
                                                           fwd.k, fwd.k_scale, stream,
                                                           "quantize_attention_training: K launch"));
  return launch_tokens_and_rows_mx<false>(kv.v, kv.v_scales, Hkv, k_side(p), fwd.v, fwd.v_scale, bwd.v, bwd.v_scale,
                                          stream, "quantize_attention_training: V launch");
}

}  // namespace
}  // namespace attn

Status quantize_attention_training_operands_mx_kv(const AttentionFwdProblem& p, const void* q, bool q_fp32,
                                                  const MxKvSource& kv, const FwdExecOperands& fwd,
                                                  const BwdExecOperands& bwd, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (q_fp32) return attn::launch_training_operands_mx_kv(p, static_cast<const float*>(q), kv, fwd, bwd, s);
  return attn::launch_training_operands_mx_kv(p, static_cast<const uint16_t*>(q), kv, fwd, bwd, s);
}

Status quantize_attention_training_operands(const AttentionFwdProblem& p, const void* q, const void* k,
                                            const void* v, bool x_fp32, const FwdExecOperands& fwd,
                                            const BwdExecOperands& bwd, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (x_fp32)
    return attn::launch_training_operands(p, static_cast<const float*>(q), static_cast<const float*>(k),
                                          static_cast<const float*>(v), fwd, bwd, s);
  return attn::launch_training_operands(p, static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k),
                                        static_cast<const uint16_t*>(v), fwd, bwd, s);
}

Status quantize_attention_bwd_operands(const AttentionBwdProblem& p, const void* q, const void* k, const void* v,
                                       bool x_fp32, const BwdExecOperands& out, bool write_qk, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (x_fp32)
    return attn::launch_bwd_operands(p, static_cast<const float*>(q), static_cast<const float*>(k),
                                     static_cast<const float*>(v), out, write_qk, s);
  return attn::launch_bwd_operands(p, static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k),
                                   static_cast<const uint16_t*>(v), out, write_qk, s);
}

Status quantize_attention_fwd_operands(const AttentionFwdProblem& p, const void* q, const void* k, const void* v,
                                       bool x_fp32, const FwdExecOperands& out, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (x_fp32)
    return attn::launch_operands(p, static_cast<const float*>(q), static_cast<const float*>(k),
                                 static_cast<const float*>(v), out, s);
  return attn::launch_operands(p, static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k),
                               static_cast<const uint16_t*>(v), out, s);
}

}  // namespace mxflash::cuda
