#include "mxflash/jagged.h"

#include <limits>
#include <string>

#include "reference/quantize_ref.h"

namespace mxflash {
namespace {
int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
}  // namespace

Status JaggedMeta::FromLengths(const std::vector<int64_t>& lengths, JaggedMeta* out) {
  if (lengths.empty()) return Status::Invalid("lengths: must hold at least one sequence");
  JaggedMeta m;
  m.cu_seqlens_.assign(1, 0);
  m.cu_seqlens_sf_.assign(1, 0);
  int64_t total = 0, padded = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    const int64_t L = lengths[b];
    if (L < 0) return Status::Invalid("lengths[" + std::to_string(b) + "]: must be >= 0, got " + std::to_string(L));
    total += L;
    padded += round_up(L, kSeqPad);
    if (padded > std::numeric_limits<int32_t>::max())
      return Status::Invalid("lengths: the 128-padded total token count must fit in int32");
    m.cu_seqlens_.push_back(int32_t(total));
    m.cu_seqlens_sf_.push_back(int32_t(padded));
    if (L > m.max_seqlen_) m.max_seqlen_ = int(L);
  }
  *out = std::move(m);
  return Status::Ok();
}

Status JaggedMeta::FromCuSeqlens(const std::vector<int32_t>& cu, JaggedMeta* out) {
  if (cu.size() < 2) return Status::Invalid("cu_seqlens: needs B+1 >= 2 entries");
  if (cu[0] != 0) return Status::Invalid("cu_seqlens: must start at 0, got " + std::to_string(cu[0]));
  std::vector<int64_t> lengths(cu.size() - 1);
  for (size_t b = 0; b + 1 < cu.size(); ++b) {
    if (cu[b + 1] < cu[b])
      return Status::Invalid("cu_seqlens: must be monotone non-decreasing (entry " + std::to_string(b + 1) +
                             " = " + std::to_string(cu[b + 1]) + " < " + std::to_string(cu[b]) + ")");
    lengths[b] = int64_t(cu[b + 1]) - cu[b];
  }
  return FromLengths(lengths, out);
}

Status JaggedMeta::CheckCuSeqlensSf(const std::vector<int32_t>& cu, const std::vector<int32_t>& sf) {
  JaggedMeta m;
  MXFLASH_RETURN_IF_ERROR(FromCuSeqlens(cu, &m));
  if (sf.size() != cu.size())
    return Status::Invalid("cu_seqlens_sf: must have as many entries as cu_seqlens (" + std::to_string(cu.size()) + ")");
  for (size_t i = 0; i < sf.size(); ++i)
    if (sf[i] != m.cu_seqlens_sf_[i])
      return Status::Invalid("cu_seqlens_sf: entry " + std::to_string(i) + " is " + std::to_string(sf[i]) +
                             ", but the prefix sum of lengths rounded up to 128 is " +
                             std::to_string(m.cu_seqlens_sf_[i]));
  return Status::Ok();
}

std::vector<int64_t> JaggedMeta::padded_to_token() const {
  std::vector<int64_t> map(size_t(padded_tokens()), -1);
  for (int b = 0; b < batch(); ++b)
    for (int i = 0; i < length(b); ++i) map[size_t(cu_seqlens_sf_[b] + i)] = cu_seqlens_[b] + i;
  return map;
}

const int32_t* JaggedMeta::device_cu_seqlens() const { return device_.get(); }
const int32_t* JaggedMeta::device_cu_seqlens_sf() const {
  return device_ ? device_.get() + cu_seqlens_.size() : nullptr;
}

ScaleShape scale_shape(const JaggedMeta& meta, int64_t H, Orientation o, ScaleLayout l) {
  const int64_t T = meta.total_tokens(), P = meta.padded_tokens();
  if (l == ScaleLayout::kBlocked128x4) {
    if (o == Orientation::kSeq) return ScaleShape{2, {H * 32, P / 8, 0}};
    return ScaleShape{2, {H * P / 4, 16, 0}};
  }
  switch (o) {
    case Orientation::kHdim: return ScaleShape{3, {T, H, 4}};
    case Orientation::kSeq: return ScaleShape{3, {P / kBlockSize, H, kHeadDim}};
    case Orientation::kSquare32: return ScaleShape{3, {P / kBlockSize, H, 4}};
  }
  return ScaleShape{0, {0, 0, 0}};
}

const char* to_string(ScalingMode m) { return m == ScalingMode::kRceil ? "rceil" : "floor"; }
const char* to_string(Orientation o) {
  switch (o) {
    case Orientation::kHdim: return "hdim";
    case Orientation::kSeq: return "seq";
    case Orientation::kSquare32: return "square32";
  }
  return "?";
}
const char* to_string(ScaleLayout l) { return l == ScaleLayout::kPlain ? "plain" : "blocked128x4"; }
const char* to_string(PayloadLayout l) {
  return l == PayloadLayout::kTokenMajor ? "token_major" : "token_contiguous";
}

}  // namespace mxflash
