// Internal: a validated quantization problem, shared by the CPU reference and the CUDA launchers.
// Pointers are host pointers for the reference and device pointers for CUDA.
#pragma once
#include <cstdint>

#include "mxflash/mx.h"

namespace mxflash::detail {

struct JaggedDims {
  int batch = 0;
  int64_t T = 0;  // total tokens
  int64_t P = 0;  // padded total (each sequence rounded up to 128)
  int64_t H = 0;  // heads
  int max_seqlen = 0;
  const int32_t* cu_seqlens = nullptr;     // B+1
  const int32_t* cu_seqlens_sf = nullptr;  // B+1
};

struct QuantizeProblem {
  JaggedDims dims;
  const void* x = nullptr;  // (T, H, 128)
  bool x_bf16 = true;       // else fp32
  ScalingMode mode = ScalingMode::kRceil;
  ScaleLayout scale_layout = ScaleLayout::kPlain;
  // hdim output (both null when not requested)
  uint8_t* hdim_payload = nullptr;  // (T, H, 128)
  uint8_t* hdim_scales = nullptr;
  // seq or square32 output (both null when not requested)
  Orientation tok_orientation = Orientation::kSeq;  // kSeq or kSquare32
  PayloadLayout tok_payload_layout = PayloadLayout::kTokenMajor;
  uint8_t* tok_payload = nullptr;
  uint8_t* tok_scales = nullptr;
};

struct DequantizeProblem {
  JaggedDims dims;
  const uint8_t* payload = nullptr;
  const uint8_t* scales = nullptr;
  Orientation orientation = Orientation::kHdim;
  ScaleLayout scale_layout = ScaleLayout::kPlain;
  PayloadLayout payload_layout = PayloadLayout::kTokenMajor;
  void* out = nullptr;  // (T, H, 128)
  bool out_bf16 = false;
};

// Layout converters: payload (T,H,128) <-> (H,128,P); scales plain <-> blocked.
struct LayoutProblem {
  JaggedDims dims;
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  Orientation orientation = Orientation::kHdim;  // for scale conversions
};

}  // namespace mxflash::detail
