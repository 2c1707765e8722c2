#include "reference/quantize_ref.h"

#include <algorithm>
#include <cstring>

#include "mxflash/jagged.h"

namespace mxflash::ref {
namespace {

float load_x(const detail::QuantizeProblem& p, int64_t i) {
  if (p.x_bf16) return bf16_to_float(static_cast<const uint16_t*>(p.x)[i]);
  return static_cast<const float*>(p.x)[i];
}

int64_t x_index(int64_t t, int64_t h, int64_t d, int64_t H) { return (t * H + h) * kHeadDim + d; }

// dequantize_element with one defined NaN pattern. A product's NaN bits are not defined by the
// source (x86/Arm return the NaN operand, the first one the compiler placed when both are NaN; a
// GPU returns its canonical NaN), so NaN outputs are pinned here to what x86 gives when one operand
// is NaN: the payload's signed quiet NaN when the element is NaN, else +qNaN for a NaN scale.
// CUDA's dequantize_value (src/cuda/quantize/mx_device.cuh) follows the same rule.
float dequantize_value(uint8_t q, uint8_t s) {
  if ((q & 0x7F) == kE4m3Nan) return bits_float((uint32_t(q & 0x80) << 24) | 0x7FC00000u);
  if (s == kE8m0Nan) return bits_float(0x7FC00000u);
  return dequantize_element(q, s);
}

// Quantizes one block of `n` values (the rest of the 32 count as zeros) and returns its scale.
uint8_t quantize_block(const float* v, int n, ScalingMode mode, uint8_t* q) {
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = amax_nan(amax, v[i]);
  const uint8_t s = e8m0_scale_byte(amax, mode, /*zero_byte=*/0);
  const float inv = e8m0_inv_scale(s);
  for (int i = 0; i < n; ++i) q[i] = quantize_element(v[i], inv);
  return s;
}

void quantize_hdim(const detail::QuantizeProblem& p) {
  const auto& d = p.dims;
  std::memset(p.hdim_scales, 0, scale_bytes(Orientation::kHdim, p.scale_layout, d.T, d.H, d.P));
  float v[kBlockSize];
  uint8_t q[kBlockSize];
  for (int b = 0; b < d.batch; ++b) {
    for (int64_t t = d.cu_seqlens[b]; t < d.cu_seqlens[b + 1]; ++t) {
      const int64_t tp = d.cu_seqlens_sf[b] + (t - d.cu_seqlens[b]);
      for (int64_t h = 0; h < d.H; ++h) {
        for (int k = 0; k < kHeadDim / kBlockSize; ++k) {
          for (int i = 0; i < kBlockSize; ++i) v[i] = load_x(p, x_index(t, h, k * kBlockSize + i, d.H));
          const uint8_t s = quantize_block(v, kBlockSize, p.mode, q);
          p.hdim_scales[hdim_scale_offset(p.scale_layout, t, tp, h, k, d.H, d.P)] = s;
          std::memcpy(p.hdim_payload + x_index(t, h, k * kBlockSize, d.H), q, kBlockSize);
        }
      }
    }
  }
}

void quantize_tok(const detail::QuantizeProblem& p) {
  const auto& d = p.dims;
  const bool square = p.tok_orientation == Orientation::kSquare32;
  std::memset(p.tok_scales, 0, scale_bytes(p.tok_orientation, p.scale_layout, d.T, d.H, d.P));
  if (p.tok_payload_layout == PayloadLayout::kTokenContiguous)
    std::memset(p.tok_payload, 0, size_t(d.H) * kHeadDim * d.P);
  std::vector<float> v(kBlockSize * kBlockSize);
  std::vector<uint8_t> q(kBlockSize * kBlockSize);
  for (int b = 0; b < d.batch; ++b) {
    const int64_t t0 = d.cu_seqlens[b], len = d.cu_seqlens[b + 1] - t0, tp0 = d.cu_seqlens_sf[b];
    for (int64_t g0 = 0; g0 < len; g0 += kBlockSize) {
      const int n = int(std::min<int64_t>(kBlockSize, len - g0));
      const int64_t g = (tp0 + g0) / kBlockSize;  // padded group index
      for (int64_t h = 0; h < d.H; ++h) {
        // Columns per block: 1 for seq, 32 for square32. Values gathered column by column.
        const int cols = square ? kBlockSize : 1;
        for (int c0 = 0; c0 < kHeadDim; c0 += cols) {
          int m = 0;
          for (int c = 0; c < cols; ++c)
            for (int i = 0; i < n; ++i) v[m++] = load_x(p, x_index(t0 + g0 + i, h, c0 + c, d.H));
          const uint8_t s = quantize_block(v.data(), m, p.mode, q.data());
          if (!square) {
            p.tok_scales[seq_scale_offset(p.scale_layout, g, h, c0, d.H, d.P)] = s;
          } else if (p.scale_layout == ScaleLayout::kPlain) {
            p.tok_scales[square_plain_scale_offset(g, h, c0 / kBlockSize, d.H)] = s;
          } else {
            for (int i = 0; i < n; ++i)
              p.tok_scales[hdim_blocked_offset(h, tp0 + g0 + i, c0 / kBlockSize, d.P)] = s;
          }
          m = 0;
          for (int c = 0; c < cols; ++c)
            for (int i = 0; i < n; ++i)
              p.tok_payload[payload_offset(p.tok_payload_layout, t0 + g0 + i, tp0 + g0 + i, h, c0 + c, d.H,
                                           d.P)] = q[m++];
        }
      }
    }
  }
}

}  // namespace

int64_t hdim_scale_offset(ScaleLayout l, int64_t t, int64_t tp, int64_t h, int64_t k, int64_t H, int64_t P) {
  return l == ScaleLayout::kPlain ? hdim_plain_offset(t, h, k, H) : hdim_blocked_offset(h, tp, k, P);
}

int64_t seq_scale_offset(ScaleLayout l, int64_t g, int64_t h, int64_t d, int64_t H, int64_t P) {
  return l == ScaleLayout::kPlain ? seq_plain_offset(g, h, d, H) : seq_blocked_offset(h, d, g, P);
}

int64_t square_plain_scale_offset(int64_t g, int64_t h, int64_t k, int64_t H) {
  return square_plain_offset(g, h, k, H);
}

int64_t payload_offset(PayloadLayout l, int64_t t, int64_t tp, int64_t h, int64_t d, int64_t H, int64_t P) {
  return l == PayloadLayout::kTokenMajor ? x_index(t, h, d, H) : (h * kHeadDim + d) * P + tp;
}

int64_t scale_bytes(Orientation o, ScaleLayout l, int64_t T, int64_t H, int64_t P) {
  if (l == ScaleLayout::kBlocked128x4) return H * P * 4;  // hdim, seq and square32 alike
  switch (o) {
    case Orientation::kHdim: return T * H * 4;
    case Orientation::kSeq: return (P / kBlockSize) * H * kHeadDim;
    case Orientation::kSquare32: return (P / kBlockSize) * H * 4;
  }
  return 0;
}

void quantize(const detail::QuantizeProblem& p) {
  if (p.hdim_payload) quantize_hdim(p);
  if (p.tok_payload) quantize_tok(p);
}

void dequantize(const detail::DequantizeProblem& p) {
  const auto& d = p.dims;
  for (int b = 0; b < d.batch; ++b) {
    for (int64_t t = d.cu_seqlens[b]; t < d.cu_seqlens[b + 1]; ++t) {
      const int64_t tp = d.cu_seqlens_sf[b] + (t - d.cu_seqlens[b]);
      const int64_t g = tp / kBlockSize;
      for (int64_t h = 0; h < d.H; ++h) {
        for (int64_t c = 0; c < kHeadDim; ++c) {
          const int64_t k = c / kBlockSize;
          int64_t so = 0;
          switch (p.orientation) {
            case Orientation::kHdim: so = hdim_scale_offset(p.scale_layout, t, tp, h, k, d.H, d.P); break;
            case Orientation::kSeq: so = seq_scale_offset(p.scale_layout, g, h, c, d.H, d.P); break;
            case Orientation::kSquare32:
              so = p.scale_layout == ScaleLayout::kPlain ? square_plain_offset(g, h, k, d.H)
                                                         : hdim_blocked_offset(h, tp, k, d.P);
              break;
          }
          const float v = dequantize_value(p.payload[payload_offset(p.payload_layout, t, tp, h, c, d.H, d.P)],
                                           p.scales[so]);
          const int64_t i = x_index(t, h, c, d.H);
          if (p.out_bf16)
            static_cast<uint16_t*>(p.out)[i] = float_to_bf16(v);
          else
            static_cast<float*>(p.out)[i] = v;
        }
      }
    }
  }
}

void to_token_contiguous(const detail::LayoutProblem& p) {
  const auto& d = p.dims;
  std::memset(p.dst, 0, size_t(d.H) * kHeadDim * d.P);
  for (int b = 0; b < d.batch; ++b)
    for (int64_t t = d.cu_seqlens[b]; t < d.cu_seqlens[b + 1]; ++t) {
      const int64_t tp = d.cu_seqlens_sf[b] + (t - d.cu_seqlens[b]);
      for (int64_t h = 0; h < d.H; ++h)
        for (int64_t c = 0; c < kHeadDim; ++c)
          p.dst[payload_offset(PayloadLayout::kTokenContiguous, t, tp, h, c, d.H, d.P)] =
              p.src[x_index(t, h, c, d.H)];
    }
}

void to_token_major(const detail::LayoutProblem& p) {
  const auto& d = p.dims;
  for (int b = 0; b < d.batch; ++b)
    for (int64_t t = d.cu_seqlens[b]; t < d.cu_seqlens[b + 1]; ++t) {
      const int64_t tp = d.cu_seqlens_sf[b] + (t - d.cu_seqlens[b]);
      for (int64_t h = 0; h < d.H; ++h)
        for (int64_t c = 0; c < kHeadDim; ++c)
          p.dst[x_index(t, h, c, d.H)] =
              p.src[payload_offset(PayloadLayout::kTokenContiguous, t, tp, h, c, d.H, d.P)];
    }
}

namespace {
// Visits every real scale byte of an orientation as (plain offset, blocked offset).
template <typename F>
void for_each_scale(const detail::JaggedDims& d, Orientation o, F&& f) {
  for (int b = 0; b < d.batch; ++b) {
    const int64_t t0 = d.cu_seqlens[b], len = d.cu_seqlens[b + 1] - t0, tp0 = d.cu_seqlens_sf[b];
    for (int64_t i = 0; i < len; ++i) {
      const int64_t t = t0 + i, tp = tp0 + i, g = tp / kBlockSize;
      const bool group_head = (i % kBlockSize) == 0;
      for (int64_t h = 0; h < d.H; ++h) {
        switch (o) {
          case Orientation::kHdim:
            for (int k = 0; k < 4; ++k) f(hdim_plain_offset(t, h, k, d.H), hdim_blocked_offset(h, tp, k, d.P), true);
            break;
          case Orientation::kSeq:
            if (group_head)
              for (int c = 0; c < kHeadDim; ++c) f(seq_plain_offset(g, h, c, d.H), seq_blocked_offset(h, c, g, d.P), true);
            break;
          case Orientation::kSquare32:
            // every token row of the blocked tensor carries the block's scale; the group's first
            // row is the one read back into the plain layout.
            for (int k = 0; k < 4; ++k) f(square_plain_offset(g, h, k, d.H), hdim_blocked_offset(h, tp, k, d.P), group_head);
            break;
        }
      }
    }
  }
}
}  // namespace

void scales_to_blocked(const detail::LayoutProblem& p) {
  const auto& d = p.dims;
  std::memset(p.dst, 0, scale_bytes(p.orientation, ScaleLayout::kBlocked128x4, d.T, d.H, d.P));
  for_each_scale(d, p.orientation, [&](int64_t plain, int64_t blocked, bool) { p.dst[blocked] = p.src[plain]; });
}

void scales_to_plain(const detail::LayoutProblem& p) {
  const auto& d = p.dims;
  std::memset(p.dst, 0, scale_bytes(p.orientation, ScaleLayout::kPlain, d.T, d.H, d.P));
  for_each_scale(d, p.orientation, [&](int64_t plain, int64_t blocked, bool primary) {
    if (primary) p.dst[plain] = p.src[blocked];
  });
}

}  // namespace mxflash::ref
