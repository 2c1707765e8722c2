// MX quantize / dequantize of packed jagged (T, H, 128) tensors and payload layout converters.
//
// Every entry point runs on the device its tensors live on: all on the CPU -> the CPU reference
// (src/reference), all on CUDA -> the CUDA kernels (bit-identical to the reference). Mixed devices,
// wrong dtypes, shapes, strides or metadata give Status::Invalid naming the argument and the rule,
// and nothing is written. CUDA work is enqueued on `stream` (a cudaStream_t, nullptr = default) and
// the call returns without synchronizing.
#pragma once
#include "mxflash/jagged.h"
#include "mxflash/mx.h"
#include "mxflash/tensor.h"

namespace mxflash {

struct QuantizeOptions {
  ScalingMode mode = ScalingMode::kRceil;
  ScaleLayout scale_layout = ScaleLayout::kPlain;
  PayloadLayout payload_layout = PayloadLayout::kTokenMajor;  // kTokenContiguous: seq / square32 only
};

// Payload shape for a layout: (T, H, 128) token-major or (H, 128, P) token-contiguous.
void payload_shape(const JaggedMeta& meta, int64_t heads, PayloadLayout l, int64_t out[3]);

// x: (T, H, 128) bf16 or fp32, contiguous. payload: e4m3 (uint8 accepted), shape per
// payload_layout. scales: e8m0 (uint8 accepted), shape scale_shape(meta, H, o, layout).
Status quantize(const TensorView& x, const JaggedMeta& meta, Orientation o, const QuantizeOptions& opt,
                TensorView payload, TensorView scales, void* stream = nullptr);

// hdim and seq quantization of x from one read. `opt.payload_layout` applies to the seq payload;
// `opt.scale_layout` to both scale tensors.
Status quantize_hdim_seq(const TensorView& x, const JaggedMeta& meta, const QuantizeOptions& opt,
                         TensorView payload_hdim, TensorView scales_hdim, TensorView payload_seq,
                         TensorView scales_seq, void* stream = nullptr);

// Inverse: out (T, H, 128) fp32 or bf16 = e4m3(payload) * scale of its block.
Status dequantize(const TensorView& payload, const TensorView& scales, const JaggedMeta& meta,
                  Orientation o, ScaleLayout scale_layout, PayloadLayout payload_layout, TensorView out,
                  void* stream = nullptr);

// Payload layout converters (any 1-byte dtype): (T, H, 128) <-> (H, 128, P). to_token_contiguous
// writes zeros in padding tokens.
Status to_token_contiguous(const TensorView& src, const JaggedMeta& meta, TensorView dst,
                           void* stream = nullptr);
Status to_token_major(const TensorView& src, const JaggedMeta& meta, TensorView dst,
                      void* stream = nullptr);

// Scale layout converters for one orientation: plain <-> blocked128x4 (padding bytes zero).
Status scales_to_blocked(const TensorView& plain, const JaggedMeta& meta, int64_t heads, Orientation o,
                         TensorView blocked, void* stream = nullptr);
Status scales_to_plain(const TensorView& blocked, const JaggedMeta& meta, int64_t heads, Orientation o,
                       TensorView plain, void* stream = nullptr);

}  // namespace mxflash
