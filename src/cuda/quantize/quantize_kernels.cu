// Host entry of the CUDA quantizer: alignment checks, kernel parameters, dispatch on the input type.
// The kernel is in quantize_kernel.cuh, its launch in quantize_launch.cuh; dequantize and the layout converters have
// their own files.
#include "cuda/quantize/quantize_cuda.h"
#include "cuda/quantize/quantize_launch.cuh"

namespace mxflash::cuda {

extern template Status launch_quantize<uint16_t>(const QuantizeParams&, const detail::QuantizeProblem&, cudaStream_t);
extern template Status launch_quantize<float>(const QuantizeParams&, const detail::QuantizeProblem&, cudaStream_t);

namespace {
// Vector widths the kernel uses: 16-byte loads of x and token-contiguous stores; token-major e4m3
// rows in 8-byte (bf16 input) or 4-byte (fp32 input) pieces.
constexpr int kInputAlign = 16;
constexpr int kTokenMajorAlign = 8;
constexpr int kTokenContiguousAlign = 16;
}  // namespace

Status quantize(const detail::QuantizeProblem& p, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_aligned(p.x, kInputAlign, "x"));
  if (p.hdim_payload) MXFLASH_RETURN_IF_ERROR(check_aligned(p.hdim_payload, kTokenMajorAlign, "payload (hdim)"));
  if (p.tok_payload) {
    const bool contiguous = p.tok_payload_layout == PayloadLayout::kTokenContiguous;
    MXFLASH_RETURN_IF_ERROR(
        check_aligned(p.tok_payload, contiguous ? kTokenContiguousAlign : kTokenMajorAlign, "payload (seq/square32)"));
  }
  QuantizeParams params;
  params.x = p.x;
  params.jd = JaggedDevice{p.dims.cu_seqlens, p.dims.cu_seqlens_sf, p.dims.batch, p.dims.P, p.dims.H};
  params.num_groups = p.dims.P / kTileTokens;
  params.mode = p.mode;
  params.blocked = p.scale_layout == ScaleLayout::kBlocked128x4;
  params.hdim_payload = p.hdim_payload;
  params.hdim_scales = p.hdim_scales;
  params.tok_payload = p.tok_payload;
  params.tok_scales = p.tok_scales;
  const auto s = static_cast<cudaStream_t>(stream);
  return p.x_bf16 ? launch_quantize<uint16_t>(params, p, s) : launch_quantize<float>(params, p, s);
}

}  // namespace mxflash::cuda
