// Jagged (packed varlen) metadata and the scale-layout byte formulas (REFERENCE.md §3).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "mxflash/mx.h"
#include "mxflash/status.h"

namespace mxflash {

// Sequences of a packed batch: tokens of all sequences concatenated.
//  cu_seqlens    (B+1) int32: starts at 0, monotone; sequence b is tokens [cu[b], cu[b+1]).
//  cu_seqlens_sf (B+1) int32: prefix sums of each length rounded up to 128 (the padded token index
//                where sequence b's scale rows, and token-contiguous payload, start).
// Zero-length sequences are legal. Host copies always; a device copy after upload().
class JaggedMeta {
 public:
  JaggedMeta() = default;
  // lengths: B >= 1 non-negative lengths; total and padded total must fit in int32.
  static Status FromLengths(const std::vector<int64_t>& lengths, JaggedMeta* out);
  static Status FromCuSeqlens(const std::vector<int32_t>& cu_seqlens, JaggedMeta* out);
  // Checks a caller-provided padded prefix array against cu_seqlens (the rule above).
  static Status CheckCuSeqlensSf(const std::vector<int32_t>& cu_seqlens,
                                 const std::vector<int32_t>& cu_seqlens_sf);

  int batch() const { return int(cu_seqlens_.size()) - 1; }  // -1 when empty
  int64_t total_tokens() const { return cu_seqlens_.empty() ? 0 : cu_seqlens_.back(); }   // T
  int64_t padded_tokens() const { return cu_seqlens_sf_.empty() ? 0 : cu_seqlens_sf_.back(); }  // P
  int max_seqlen() const { return max_seqlen_; }
  int length(int b) const { return cu_seqlens_[b + 1] - cu_seqlens_[b]; }
  const std::vector<int32_t>& cu_seqlens() const { return cu_seqlens_; }
  const std::vector<int32_t>& cu_seqlens_sf() const { return cu_seqlens_sf_; }
  // Per padded token p in [0, P): the real token index, or -1 for padding. Host helper.
  std::vector<int64_t> padded_to_token() const;

  // Device copies of cu_seqlens and cu_seqlens_sf (one allocation, 2*(B+1) int32), made once,
  // shared by copies of this object. Unsupported without CUDA.
  Status upload();
  bool on_device() const { return device_ != nullptr; }
  const int32_t* device_cu_seqlens() const;
  const int32_t* device_cu_seqlens_sf() const;
  // Copies device arrays back and checks they equal the host copies (a caller-provided device
  // metadata must match the host one the launcher validates).
  static Status CheckDeviceCopy(const JaggedMeta& meta, const int32_t* d_cu_seqlens,
                                const int32_t* d_cu_seqlens_sf);

 private:
  std::vector<int32_t> cu_seqlens_;
  std::vector<int32_t> cu_seqlens_sf_;
  int max_seqlen_ = 0;
  std::shared_ptr<int32_t> device_;  // 2*(B+1) int32 on the device, freed with the last copy
};

// ---------------------------------------------------------------- scale layout formulas
// Padded token index of token t of sequence b: cu_seqlens_sf[b] + (t - cu_seqlens[b]).
// Atom: a 128-row x 4-column tile of scale bytes stored as 512 contiguous bytes.
MXFLASH_HD int64_t blocked_byte_in_atom(int64_t r, int64_t c) { return 16 * (r % 32) + 4 * (r / 32) + c; }

// hdim scales, blocked: tensor (H*P/4, 16). Head h, padded token tp, head-dim block k (0..3).
MXFLASH_HD int64_t hdim_blocked_offset(int64_t h, int64_t tp, int64_t k, int64_t P) {
  const int64_t R = h * P + tp;
  return 512 * (R / 128) + 16 * (R % 32) + 4 * ((R % 128) / 32) + k;
}
// seq scales, blocked: tensor (H*32, P/8). Head h, column d (0..127), padded token group g = tp/32.
MXFLASH_HD int64_t seq_blocked_offset(int64_t h, int64_t d, int64_t g, int64_t P) {
  return 512 * (h * (P / 128) + g / 4) + 16 * (d % 32) + 4 * (d / 32) + (g % 4);
}
// Plain layouts (row-major):
//  hdim     (T, H, 4):    token t (real index), head h, block k.
//  seq      (P/32, H, 128): padded token group g, head h, column d; padding groups hold 0.
//  square32 (P/32, H, 4):   padded token group g, head h, block k; padding groups hold 0.
MXFLASH_HD int64_t hdim_plain_offset(int64_t t, int64_t h, int64_t k, int64_t H) { return (t * H + h) * 4 + k; }
MXFLASH_HD int64_t seq_plain_offset(int64_t g, int64_t h, int64_t d, int64_t H) { return (g * H + h) * 128 + d; }
MXFLASH_HD int64_t square_plain_offset(int64_t g, int64_t h, int64_t k, int64_t H) { return (g * H + h) * 4 + k; }
// square32 scales in the blocked layout are written as the hdim blocked tensor (H*P/4, 16),
// each token row carrying its 32x32 block's scale (what a Blackwell kernel contracting over the
// head dim consumes).

// Shape of the scale tensor for (orientation, layout), as 2 or 3 dims.
struct ScaleShape {
  int ndim;
  int64_t dims[3];
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= dims[i];
    return n;
  }
};
ScaleShape scale_shape(const JaggedMeta& meta, int64_t heads, Orientation o, ScaleLayout l);

}  // namespace mxflash
