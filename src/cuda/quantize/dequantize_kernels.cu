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

// hdim, plain scales, token-major payload: the tensor is a flat run of 32-element blocks, block i's
// scale byte at scales[i] (every token's H x 4 bytes in order). A thread takes 8 payload bytes (a
// quarter block) at a time and writes its 8 outputs with one 16-byte store (bf16) or two; memory-
// bound (the tile walk above costs 2.5x the time on the module's K and V). Same value rule as
// dequantize_value, so the same bytes.
constexpr int kFlatThreads = 256;

template <bool kOutBf16>
__global__ void __launch_bounds__(kFlatThreads) dequantize_flat_kernel(const uint8_t* __restrict__ payload,
                                                                       const uint8_t* __restrict__ scales,
                                                                       int64_t quarters, void* __restrict__ out) {
  for (int64_t i = int64_t(blockIdx.x) * kFlatThreads + threadIdx.x; i < quarters;
       i += int64_t(gridDim.x) * kFlatThreads) {
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(payload) + i);
    const uint32_t s = __ldg(scales + i / 4);
    if constexpr (kOutBf16) {
      reinterpret_cast<uint4*>(out)[i] = dequantize8_bf16(q.x, q.y, s);
    } else {
      float v[8];
      dequantize8(q.x, q.y, s, v);
      float4* dst = reinterpret_cast<float4*>(out) + 2 * i;
      dst[0] = make_float4(v[0], v[1], v[2], v[3]);
      dst[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
  }
}

template <bool kOutBf16>
Status run_flat(const detail::DequantizeProblem& p, cudaStream_t stream) {
  constexpr auto kernel = dequantize_flat_kernel<kOutBf16>;
  const int64_t quarters = int64_t(p.dims.T) * p.dims.H * kHeadDim / 8;
  if (quarters == 0) return Status::Ok();
  int grid = 0;
  MXFLASH_RETURN_IF_ERROR(grid_size<kernel>(kFlatThreads, (quarters + kFlatThreads - 1) / kFlatThreads, &grid));
  kernel<<<grid, kFlatThreads, 0, stream>>>(p.payload, p.scales, quarters, p.out);
  return check_launch("dequantize_flat_kernel");
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
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.orientation == Orientation::kHdim && p.scale_layout == ScaleLayout::kPlain)
    return p.out_bf16 ? run_flat<true>(p, s) : run_flat<false>(p, s);
  DequantizeParams params;
  params.payload = p.payload;
  params.scales = p.scales;
  params.out = p.out;
  params.jd = JaggedDevice{p.dims.cu_seqlens, p.dims.cu_seqlens_sf, p.dims.batch, p.dims.P, p.dims.H};
  params.num_groups = p.dims.P / kTileTokens;
  params.blocked = p.scale_layout == ScaleLayout::kBlocked128x4;
  return p.out_bf16 ? run_orientation<true>(params, p.orientation, contiguous, s)
                    : run_orientation<false>(params, p.orientation, contiguous, s);
}

}  // namespace mxflash::cuda
