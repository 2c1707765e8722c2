// Host entry of CUDA dequantization: alignment checks and dispatch on output type, orientation and
// payload layout. The kernel is in dequantize_kernel.cuh.
#include <cuda_runtime.h>

#include "cuda/quantize/dequantize_kernel.cuh"
#include "cuda/common/launch_utils.cuh"
#include "cuda/quantize/quantize_cuda.h"

namespace mxflash::cuda {
namespace {

template <bool kOutBf16, Orientation kO, bool kContiguous>
Status run(const DequantizeParams& params, cudaStream_t stream) {
  constexpr auto kernel = dequantize_kernel<kOutBf16, kO, kContiguous>;
  int grid = 0;
  MXFLASH_RETURN_IF_ERROR(grid_size<kernel>(kTileThreads, params.num_groups * params.jd.H, &grid));
  kernel<<<grid, kTileThreads, 0, stream>>>(params);
  return check_launch("dequantize_kernel");
}

template <bool kOutBf16, Orientation kO>
Status run_layout(const DequantizeParams& params, bool contiguous, cudaStream_t stream) {
  return contiguous ? run<kOutBf16, kO, true>(params, stream) : run<kOutBf16, kO, false>(params, stream);
}

template <bool kOutBf16>
Status run_orientation(const DequantizeParams& params, Orientation o, bool contiguous, cudaStream_t stream) {
  switch (o) {
    case Orientation::kHdim:
      return run<kOutBf16, Orientation::kHdim, false>(params, stream);
    case Orientation::kSeq:
      return run_layout<kOutBf16, Orientation::kSeq>(params, contiguous, stream);
    case Orientation::kSquare32:
      return run_layout<kOutBf16, Orientation::kSquare32>(params, contiguous, stream);
  }
  return Status::Internal("dequantize: unknown orientation");
}

// Vector widths: 8-byte token-major payload rows, 16-byte token-contiguous halves and output rows.
constexpr int kTokenMajorAlign = 8;
constexpr int kTokenContiguousAlign = 16;
constexpr int kOutAlign = 16;

}  // namespace

Status dequantize(const detail::DequantizeProblem& p, void* stream) {
  const bool contiguous = p.payload_layout == PayloadLayout::kTokenContiguous;
  if (contiguous && p.orientation == Orientation::kHdim)
    return Status::Invalid("payload_layout: hdim payloads are token_major only");
  MXFLASH_RETURN_IF_ERROR(check_aligned(p.payload, contiguous ? kTokenContiguousAlign : kTokenMajorAlign, "payload"));
  MXFLASH_RETURN_IF_ERROR(check_aligned(p.out, kOutAlign, "out"));
  DequantizeParams params;
  params.payload = p.payload;
  params.scales = p.scales;
  params.out = p.out;
  params.jd = JaggedDevice{p.dims.cu_seqlens, p.dims.cu_seqlens_sf, p.dims.batch, p.dims.P, p.dims.H};
  params.num_groups = p.dims.P / kTileTokens;
  params.blocked = p.scale_layout == ScaleLayout::kBlocked128x4;
  const auto s = static_cast<cudaStream_t>(stream);
  return p.out_bf16 ? run_orientation<true>(params, p.orientation, contiguous, s)
                    : run_orientation<false>(params, p.orientation, contiguous, s);
}

}  // namespace mxflash::cuda
