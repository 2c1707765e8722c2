// Host entry of the CUDA layout converters: alignment checks and launches. Kernels in
// layout_kernels.cuh.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/launch_utils.cuh"
#include "cuda/quantize/layout_kernels.cuh"
#include "cuda/quantize/quantize_cuda.h"

namespace mxflash::cuda {
namespace {

template <auto Kernel, typename Params>
Status run(const Params& params, int64_t work_ctas, const char* name, cudaStream_t stream) {
  int grid = 0;
  MXFLASH_RETURN_IF_ERROR(grid_size<Kernel>(kTileThreads, work_ctas, &grid));
  Kernel<<<grid, kTileThreads, 0, stream>>>(params);
  return check_launch(name);
}

JaggedDevice jagged_of(const detail::LayoutProblem& p) {
  return JaggedDevice{p.dims.cu_seqlens, p.dims.cu_seqlens_sf, p.dims.batch, p.dims.P, p.dims.H};
}

PayloadParams payload_params(const detail::LayoutProblem& p) {
  return PayloadParams{p.src, p.dst, jagged_of(p), p.dims.P / kTileTokens};
}

template <bool kToBlocked>
Status run_scales(const detail::LayoutProblem& p, void* stream) {
  // hdim and square32 move 4-byte words (one token row's 4 blocks).
  if (p.orientation != Orientation::kSeq) {
    MXFLASH_RETURN_IF_ERROR(check_aligned(p.src, 4, "scales (source)"));
    MXFLASH_RETURN_IF_ERROR(check_aligned(p.dst, 4, "scales (destination)"));
  }
  const ScaleParams params{p.src, p.dst, jagged_of(p), p.dims.P / kTileTokens};
  const int64_t tiles = params.num_groups * p.dims.H;
  const int64_t ctas = (tiles + kTileWarps - 1) / kTileWarps;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (p.orientation) {
    case Orientation::kHdim:
      return run<scale_layout_kernel<Orientation::kHdim, kToBlocked>>(params, ctas, "scale_layout_kernel", s);
    case Orientation::kSeq:
      return run<scale_layout_kernel<Orientation::kSeq, kToBlocked>>(params, ctas, "scale_layout_kernel", s);
    case Orientation::kSquare32:
      return run<scale_layout_kernel<Orientation::kSquare32, kToBlocked>>(params, ctas, "scale_layout_kernel", s);
  }
  return Status::Internal("scale layout: unknown orientation");
}

// Vector widths: 8-byte token-major rows, 16-byte token-contiguous halves.
constexpr int kTokenMajorAlign = 8;
constexpr int kTokenContiguousAlign = 16;

}  // namespace

Status to_token_contiguous(const detail::LayoutProblem& p, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_aligned(p.src, kTokenMajorAlign, "src"));
  MXFLASH_RETURN_IF_ERROR(check_aligned(p.dst, kTokenContiguousAlign, "dst"));
  const PayloadParams params = payload_params(p);
  return run<to_token_contiguous_kernel>(params, params.num_groups * p.dims.H, "to_token_contiguous_kernel",
                                         static_cast<cudaStream_t>(stream));
}

Status to_token_major(const detail::LayoutProblem& p, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_aligned(p.src, kTokenContiguousAlign, "src"));
  MXFLASH_RETURN_IF_ERROR(check_aligned(p.dst, kTokenMajorAlign, "dst"));
  const PayloadParams params = payload_params(p);
  return run<to_token_major_kernel>(params, params.num_groups * p.dims.H, "to_token_major_kernel",
                                    static_cast<cudaStream_t>(stream));
}

Status scales_to_blocked(const detail::LayoutProblem& p, void* stream) { return run_scales<true>(p, stream); }
Status scales_to_plain(const detail::LayoutProblem& p, void* stream) { return run_scales<false>(p, stream); }

}  // namespace mxflash::cuda
