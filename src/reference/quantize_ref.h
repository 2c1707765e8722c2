// CPU reference of MX quantization: the definition every GPU kernel is compared to, byte for byte.
#pragma once
#include "common/quantize_problem.h"

namespace mxflash::ref {

// Scale-tensor byte offsets of one block, for every orientation and layout (jagged.h formulas).
int64_t hdim_scale_offset(ScaleLayout l, int64_t t, int64_t tp, int64_t h, int64_t k, int64_t H, int64_t P);
int64_t seq_scale_offset(ScaleLayout l, int64_t g, int64_t h, int64_t d, int64_t H, int64_t P);
// square32: plain offset of block (g, h, k); blocked layouts replicate per token (see jagged.h).
int64_t square_plain_scale_offset(int64_t g, int64_t h, int64_t k, int64_t H);
// Payload byte offset of (token t / padded token tp, head h, column d) in a payload layout.
int64_t payload_offset(PayloadLayout l, int64_t t, int64_t tp, int64_t h, int64_t d, int64_t H, int64_t P);
// Bytes of a scale tensor for (orientation, layout).
int64_t scale_bytes(Orientation o, ScaleLayout l, int64_t T, int64_t H, int64_t P);

// Fills every byte of the requested outputs (padding included).
void quantize(const detail::QuantizeProblem& p);
void dequantize(const detail::DequantizeProblem& p);
void to_token_contiguous(const detail::LayoutProblem& p);
void to_token_major(const detail::LayoutProblem& p);
void scales_to_blocked(const detail::LayoutProblem& p);
void scales_to_plain(const detail::LayoutProblem& p);

}  // namespace mxflash::ref
