// Host side of the quantization kernel: picks the variant for the requested outputs and launches it.
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include "common/quantize_problem.h"
#include "cuda/quantize/launch_utils.cuh"
#include "cuda/quantize/quantize_hdim_seq_kernel.cuh"
#include "cuda/quantize/quantize_kernel.cuh"
#include "mxflash/status.h"

namespace mxflash::cuda {

// hdim + seq from one read of bf16 x: true runs quantize_hdim_seq_kernel (quantize_hdim_seq_kernel.cuh),
// false the generic quantize_kernel<uint16_t, true, TokOut::kSeq, *>. Same bytes either way (the
// GPU tests compare whichever is built with the CPU reference). The default stays the generic
// kernel, the one measured and tested on the H200 (0.84 of copy); the lean one was written after the
// session's GPU time ran out and is verified only by CPU emulation. To A/B them, build a second tree
// with -DCMAKE_CUDA_FLAGS=-DMXFLASH_LEAN_HDIM_SEQ=1, run the GPU tests and mxflash-bench there, and
// flip the default here if it wins.
#ifndef MXFLASH_LEAN_HDIM_SEQ
#define MXFLASH_LEAN_HDIM_SEQ 0
#endif
inline constexpr bool kLeanHdimSeq = MXFLASH_LEAN_HDIM_SEQ != 0;

template <bool kTokContiguous>
Status run_hdim_seq_kernel(const QuantizeParams& params, cudaStream_t stream) {
  constexpr auto kernel = quantize_hdim_seq_kernel<kTokContiguous>;
  int grid = 0;
  MXFLASH_RETURN_IF_ERROR(grid_size<kernel>(kTileThreads, params.num_groups / kStripTiles * params.jd.H, &grid));
  kernel<<<grid, kTileThreads, 0, stream>>>(params);
  return check_launch("quantize_hdim_seq_kernel");
}

template <typename In, bool kHdim, TokOut kTok, bool kTokContiguous>
Status run_quantize_kernel(const QuantizeParams& params, cudaStream_t stream) {
  constexpr auto kernel = quantize_kernel<In, kHdim, kTok, kTokContiguous>;
  int grid = 0;
  MXFLASH_RETURN_IF_ERROR(grid_size<kernel>(kTileThreads, params.num_groups / kStripTiles * params.jd.H, &grid));
  kernel<<<grid, kTileThreads, 0, stream>>>(params);
  return check_launch("quantize_kernel");
}

template <typename In, bool kHdim, TokOut kTok>
Status run_quantize_layout(const QuantizeParams& params, bool contiguous, cudaStream_t stream) {
  if constexpr (kLeanHdimSeq && std::is_same_v<In, uint16_t> && kHdim && kTok == TokOut::kSeq)
    return contiguous ? run_hdim_seq_kernel<true>(params, stream) : run_hdim_seq_kernel<false>(params, stream);
  else
    return contiguous ? run_quantize_kernel<In, kHdim, kTok, true>(params, stream)
                      : run_quantize_kernel<In, kHdim, kTok, false>(params, stream);
}

// Picks the kernel variant for the requested outputs. Explicitly instantiated once per input
// type (quantize_bf16.cu, quantize_fp32.cu) so the variants compile in parallel.
template <typename In>
Status launch_quantize(const QuantizeParams& params, const detail::QuantizeProblem& p, cudaStream_t stream) {
  const bool hdim = p.hdim_payload != nullptr;
  const bool contiguous = p.tok_payload_layout == PayloadLayout::kTokenContiguous;
  if (p.tok_payload == nullptr) return run_quantize_kernel<In, true, TokOut::kNone, false>(params, stream);
  if (p.tok_orientation == Orientation::kSquare32)
    return hdim ? run_quantize_layout<In, true, TokOut::kSquare32>(params, contiguous, stream)
                : run_quantize_layout<In, false, TokOut::kSquare32>(params, contiguous, stream);
  return hdim ? run_quantize_layout<In, true, TokOut::kSeq>(params, contiguous, stream)
              : run_quantize_layout<In, false, TokOut::kSeq>(params, contiguous, stream);
}

}  // namespace mxflash::cuda
