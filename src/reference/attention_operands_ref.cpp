// CPU reference of the forward's operands in the fast kernel's execution layout
// (mxflash::AttentionFwdOperands): the MX quantizer's bytes, then each block's bytes re-expressed to
// the largest block scale of its group. Written from the layout's definition, independently of the
// CUDA kernels it checks (attention_fwd_operands.cu, attention_fwd_prepare.cuh).
#include <algorithm>
#include <cmath>

#include "mxflash/mx.h"
#include "mxflash/quantize.h"
#include "mxflash/tensor.h"
#include "reference/attention_ref.h"

namespace mxflash::ref {
namespace {

constexpr int kD = kHeadDim;
constexpr int kTile = 128;

// MX bytes of x (T, H, 128) fp32 in orientation o: token-major payload, plain scales.
Status mx_bytes(const float* x, const JaggedMeta& m, int64_t H, Orientation o, std::vector<uint8_t>* payload,
                std::vector<uint8_t>* scales) {
  const int64_t T = m.total_tokens();
  const ScaleShape ss = scale_shape(m, H, o, ScaleLayout::kPlain);
  payload->assign(size_t(T * H * kD), 0);
  scales->assign(size_t(ss.numel()), 0);
  if (T == 0) return Status::Ok();
  return quantize(make_view(const_cast<float*>(x), DType::kFloat32, Device::kCPU, {T, H, kD}), m, o, QuantizeOptions{},
                  make_view(payload->data(), DType::kE4M3, Device::kCPU, {T, H, kD}),
                  make_view(scales->data(), DType::kE8M0, Device::kCPU, ss.ndim, ss.dims));
}

// Position k (0..31) of a 32-token group of V' holds token fragment_token(k) of the group: the
// order of the wgmma A fragment a thread packs from its S accumulators (columns 2q, 2q+1, 8+2q,
// 9+2q, then the same 16 columns on).
int fragment_token(int k) {
  const int half = k / 16, q = (k % 16) / 4, j = k % 4;
  return 16 * half + 2 * q + (j / 2) * 8 + (j % 2);
}

}  // namespace

uint8_t shift_e4m3_byte(uint8_t b, int shift) {
  if (shift <= 0 || (b & 0x7F) == 0x7F) return b;  // NaN stays NaN
  uint8_t r = float_to_e4m3(std::ldexp(e4m3_to_float(b), -shift), /*saturate=*/true);
  if ((r & 0x7F) == 0) r = uint8_t(b & 0x80);  // a zero keeps the input's sign
  return r;
}

Status attention_fwd_operands(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t H, const float* q,
                              const float* k, const float* v, AttnFwdOperands* out) {
  const int64_t Pq = q_meta.padded_tokens(), Pk = k_meta.padded_tokens(), kt = Pk / kTile;
  std::vector<uint8_t> pay, sc;
  out->q.assign(size_t(H * Pq * kD), 0);
  out->q_scale.assign(size_t(H * Pq), 1.f);
  out->k.assign(size_t(H * Pk * kD), 0);
  out->k_scale.assign(size_t(H * kt), 0.f);
  out->v.assign(size_t(H * kD * Pk), 0);
  out->v_scale.assign(size_t(H * kt), 0.f);
  // Q and K: hdim blocks re-expressed per row (Q) or per (head, 128-key tile) (K).
  for (int which = 0; which < 2; ++which) {
    const JaggedMeta& m = which == 0 ? q_meta : k_meta;
    const int64_t P = which == 0 ? Pq : Pk;
    std::vector<uint8_t>& dst = which == 0 ? out->q : out->k;
    MXFLASH_RETURN_IF_ERROR(mx_bytes(which == 0 ? q : k, m, H, Orientation::kHdim, &pay, &sc));
    for (int b = 0; b < m.batch(); ++b) {
      const int64_t t0 = m.cu_seqlens()[b], len = m.cu_seqlens()[b + 1] - t0, p0 = m.cu_seqlens_sf()[b];
      for (int64_t h = 0; h < H; ++h)
        for (int64_t first = 0; first < len; first += kTile) {
          const int64_t rows = std::min<int64_t>(kTile, len - first);
          int tile_max = 0;
          for (int64_t r = 0; r < rows; ++r)
            for (int blk = 0; blk < 4; ++blk)
              tile_max = std::max(tile_max, int(sc[size_t(hdim_plain_offset(t0 + first + r, h, blk, H))]));
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t t = t0 + first + r, row = h * P + p0 + first + r;
            int group = tile_max;
            if (which == 0) {
              group = 0;
              for (int blk = 0; blk < 4; ++blk) group = std::max(group, int(sc[size_t(hdim_plain_offset(t, h, blk, H))]));
              out->q_scale[size_t(row)] = e8m0_to_float(uint8_t(group));
            }
            for (int d = 0; d < kD; ++d) {
              const int s = sc[size_t(hdim_plain_offset(t, h, d / 32, H))];
              dst[size_t(row * kD + d)] = shift_e4m3_byte(pay[size_t((t * H + h) * kD + d)], group - s);
            }
          }
          if (which == 1) out->k_scale[size_t(h * kt + (p0 + first) / kTile)] = e8m0_to_float(uint8_t(tile_max));
        }
    }
  }
  // V: seq blocks (32 tokens x 1 channel) re-expressed per (head, 128-key tile) to the tile's largest
  // finite block scale, stored as V' (H, 128, Pk) with each 32-token group in fragment order. A
  // block whose scale is NaN (it holds an inf or NaN) becomes NaN bytes: its channel turns NaN, as in
  // exact MX, and the other channels keep their values.
  MXFLASH_RETURN_IF_ERROR(mx_bytes(v, k_meta, H, Orientation::kSeq, &pay, &sc));
  for (int b = 0; b < k_meta.batch(); ++b) {
    const int64_t t0 = k_meta.cu_seqlens()[b], len = k_meta.cu_seqlens()[b + 1] - t0, p0 = k_meta.cu_seqlens_sf()[b];
    for (int64_t h = 0; h < H; ++h)
      for (int64_t first = 0; first < len; first += kTile) {
        const int64_t tile = (p0 + first) / kTile;
        auto block_scale = [&](int g, int d) { return int(sc[size_t(seq_plain_offset((p0 + first) / 32 + g, h, d, H))]); };
        int tile_max = 0;
        for (int d = 0; d < kD; ++d)
          for (int g = 0; g < 4 && first + 32 * g < len; ++g)
            if (block_scale(g, d) != 0xFF) tile_max = std::max(tile_max, block_scale(g, d));
        out->v_scale[size_t(h * kt + tile)] = e8m0_to_float(uint8_t(tile_max));
        for (int d = 0; d < kD; ++d)
          for (int pos = 0; pos < kTile; ++pos) {
            const int64_t i = first + 32 * (pos / 32) + fragment_token(pos % 32);  // token of the sequence
            if (i >= len) continue;
            const int s = block_scale(pos / 32, d);
            out->v[size_t((h * kD + d) * Pk + p0 + first + pos)] =
                s == 0xFF ? uint8_t(0x7F) : shift_e4m3_byte(pay[size_t(((t0 + i) * H + h) * kD + d)], tile_max - s);
          }
      }
  }
  return Status::Ok();
}

}  // namespace mxflash::ref
