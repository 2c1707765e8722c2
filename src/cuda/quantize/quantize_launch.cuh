// Host side of the quantization kernel: picks the variant for the requested outputs and launches it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "common/quantize_problem.h"
#include "cuda/common/launch_utils.cuh"
#include "cuda/quantize/quantize_hdim_seq_kernel.cuh"
#include "cuda/quantize/quantize_kernel.cuh"
#include "mxflash/status.h"

namespace mxflash::cuda {

// hdim + seq from one read of bf16 x: true runs quantize_hdim_seq_kernel (quantize_hdim_seq_kernel.cuh),
// false the generic quantize_kernel<uint16_t, true, TokOut::kSeq, *>. Same bytes either way (the
// GPU tests compare whichever runs with the CPU reference). The default stays the generic kernel;
// MXFLASH_QUANT_VARIANT bit 0 (below) selects the lean one at run time, this macro at build time.
#ifndef MXFLASH_LEAN_HDIM_SEQ
#define MXFLASH_LEAN_HDIM_SEQ 0
#endif
inline constexpr bool kLeanHdimSeq = MXFLASH_LEAN_HDIM_SEQ != 0;

// MXFLASH_QUANT_VARIANT (environment, read once per process; unset or 0 = the default kernels), so
// one binary can A/B the quantize kernel variants on a GPU. A bit mask:
//   bit 0 (1): hdim+seq from bf16 input runs quantize_hdim_seq_kernel (the lean kernel) instead of
//              the generic quantize_kernel.
//   bit 1 (2): blocked scale layout: each strip's 512-byte scale atoms are staged in shared memory
//              and written once, as whole lines (store_staged_atoms, quantize_kernel.cuh), instead
//              of 4 partial writes of every sector a tile apart. Every orientation and input type;
//              only where both scale tensors are 16-byte aligned (otherwise the direct path runs).
//   bit 2 (4): the lean kernel's payload stores are st.global.cs (L2 evict-first). Only with bit 0.
//   bit 3 (8): one wave of resident CTAs looping over the strips (the kernels' former launch)
//              instead of one CTA per strip. Every kernel. Measured on an H200 (1 GiB bf16, 3
//              heads, docs/performance.md): the wave reaches 0.88-0.91 of copy bandwidth alone and
//              0.83 for hdim+seq, one CTA per strip 0.98-0.99 and 0.91: with a resident wave the
//              last round of strips runs on a fraction of the CTAs, so at a fraction of the
//              bandwidth, while the hardware hands single strips to whichever SM frees a slot.
// Values to A/B: 0 (default), 1, 2, 3, 7, 8, 15. Every variant writes the same bytes (GPU tests:
// MXFLASH_QUANT_VARIANT=N mxflash_tests_gpu --gtest_filter='QuantizeGpu.*').
inline constexpr int kVariantLean = 1, kVariantStageScales = 2, kVariantStreamStores = 4, kVariantWave = 8;
inline int quant_variant() {
  static const int v = [] {
    const char* e = std::getenv("MXFLASH_QUANT_VARIANT");
    return e ? std::atoi(e) : 0;
  }();
  return v;
}

// Grid of a strip-walking quantize kernel: one CTA per strip (default) or one wave of resident CTAs.
template <auto Kernel>
Status quantize_grid(int64_t strips, int* grid) {
  if ((quant_variant() & kVariantWave) != 0) return grid_size<Kernel>(kTileThreads, strips, grid);
  constexpr int64_t kMaxGrid = 0x7FFFFFFF;  // gridDim.x; the kernels loop when strips exceed it
  *grid = int(strips < 1 ? 1 : (strips < kMaxGrid ? strips : kMaxGrid));
  return Status::Ok();
}

template <bool kTokContiguous, bool kStage, bool kStream>
Status run_hdim_seq_kernel(const QuantizeParams& params, cudaStream_t stream) {
  constexpr auto kernel = quantize_hdim_seq_kernel<kTokContiguous, kStage, kStream>;
  int grid = 0;
  MXFLASH_RETURN_IF_ERROR(quantize_grid<kernel>(params.num_groups / kStripTiles * params.jd.H, &grid));
  kernel<<<grid, kTileThreads, 0, stream>>>(params);
  return check_launch("quantize_hdim_seq_kernel");
}

template <bool kTokContiguous>
Status run_hdim_seq_variant(const QuantizeParams& params, bool stage, bool stream_stores, cudaStream_t stream) {
  if (stage)
    return stream_stores ? run_hdim_seq_kernel<kTokContiguous, true, true>(params, stream)
                         : run_hdim_seq_kernel<kTokContiguous, true, false>(params, stream);
  return stream_stores ? run_hdim_seq_kernel<kTokContiguous, false, true>(params, stream)
                       : run_hdim_seq_kernel<kTokContiguous, false, false>(params, stream);
}

template <typename In, bool kHdim, TokOut kTok, bool kTokContiguous, bool kStage>
Status run_quantize_kernel(const QuantizeParams& params, cudaStream_t stream) {
  constexpr auto kernel = quantize_kernel<In, kHdim, kTok, kTokContiguous, kStage>;
  int grid = 0;
  MXFLASH_RETURN_IF_ERROR(quantize_grid<kernel>(params.num_groups / kStripTiles * params.jd.H, &grid));
  kernel<<<grid, kTileThreads, 0, stream>>>(params);
  return check_launch("quantize_kernel");
}

template <typename In, bool kHdim, TokOut kTok, bool kTokContiguous>
Status run_quantize_staged(const QuantizeParams& params, bool stage, cudaStream_t stream) {
  return stage ? run_quantize_kernel<In, kHdim, kTok, kTokContiguous, true>(params, stream)
               : run_quantize_kernel<In, kHdim, kTok, kTokContiguous, false>(params, stream);
}

template <typename In, bool kHdim, TokOut kTok>
Status run_quantize_layout(const QuantizeParams& params, bool contiguous, bool stage, cudaStream_t stream) {
  if constexpr (std::is_same_v<In, uint16_t> && kHdim && kTok == TokOut::kSeq) {
    const int v = quant_variant();
    if (kLeanHdimSeq || (v & kVariantLean) != 0) {
      const bool stream_stores = (v & kVariantStreamStores) != 0;
      return contiguous ? run_hdim_seq_variant<true>(params, stage, stream_stores, stream)
                        : run_hdim_seq_variant<false>(params, stage, stream_stores, stream);
    }
  }
  return contiguous ? run_quantize_staged<In, kHdim, kTok, true>(params, stage, stream)
                    : run_quantize_staged<In, kHdim, kTok, false>(params, stage, stream);
}

// Picks the kernel variant for the requested outputs. Explicitly instantiated once per input
// type (quantize_bf16.cu, quantize_fp32.cu) so the variants compile in parallel.
template <typename In>
Status launch_quantize(const QuantizeParams& params, const detail::QuantizeProblem& p, cudaStream_t stream) {
  const bool hdim = p.hdim_payload != nullptr;
  const bool contiguous = p.tok_payload_layout == PayloadLayout::kTokenContiguous;
  const bool stage = (quant_variant() & kVariantStageScales) != 0 && params.blocked &&
                     is_aligned(p.hdim_scales, 16) && is_aligned(p.tok_scales, 16);  // (null: aligned)
  if (p.tok_payload == nullptr) return run_quantize_staged<In, true, TokOut::kNone, false>(params, stage, stream);
  if (p.tok_orientation == Orientation::kSquare32)
    return hdim ? run_quantize_layout<In, true, TokOut::kSquare32>(params, contiguous, stage, stream)
                : run_quantize_layout<In, false, TokOut::kSquare32>(params, contiguous, stage, stream);
  return hdim ? run_quantize_layout<In, true, TokOut::kSeq>(params, contiguous, stage, stream)
              : run_quantize_layout<In, false, TokOut::kSeq>(params, contiguous, stage, stream);
}

}  // namespace mxflash::cuda
