// JaggedMeta construction, validation and the scale-layout examples of REFERENCE.md §3.
#include <gtest/gtest.h>

#include "mxflash/jagged.h"

namespace mxflash {
namespace {

TEST(JaggedMeta, ReferenceExample) {
  JaggedMeta m;
  ASSERT_TRUE(JaggedMeta::FromLengths({17, 0, 129}, &m).ok());
  EXPECT_EQ(m.cu_seqlens(), (std::vector<int32_t>{0, 17, 17, 146}));
  EXPECT_EQ(m.cu_seqlens_sf(), (std::vector<int32_t>{0, 128, 128, 384}));
  EXPECT_EQ(m.max_seqlen(), 129);
  EXPECT_EQ(m.total_tokens(), 146);
  EXPECT_EQ(m.padded_tokens(), 384);
  const ScaleShape hb = scale_shape(m, 16, Orientation::kHdim, ScaleLayout::kBlocked128x4);
  EXPECT_EQ(hb.ndim, 2);
  EXPECT_EQ(hb.dims[0], 1536);
  EXPECT_EQ(hb.dims[1], 16);
  const ScaleShape sb = scale_shape(m, 16, Orientation::kSeq, ScaleLayout::kBlocked128x4);
  EXPECT_EQ(sb.dims[0], 512);
  EXPECT_EQ(sb.dims[1], 48);
}

TEST(JaggedMeta, FromCuSeqlensMatchesFromLengths) {
  JaggedMeta a, b;
  ASSERT_TRUE(JaggedMeta::FromLengths({0, 1, 31, 32, 33, 127, 128, 129}, &a).ok());
  ASSERT_TRUE(JaggedMeta::FromCuSeqlens(a.cu_seqlens(), &b).ok());
  EXPECT_EQ(a.cu_seqlens_sf(), b.cu_seqlens_sf());
  EXPECT_TRUE(JaggedMeta::CheckCuSeqlensSf(a.cu_seqlens(), a.cu_seqlens_sf()).ok());
}

TEST(JaggedMeta, RejectsBadInput) {
  JaggedMeta m;
  Status s = JaggedMeta::FromLengths({}, &m);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("lengths"), std::string::npos);
  s = JaggedMeta::FromLengths({3, -1}, &m);
  EXPECT_NE(s.message().find("lengths[1]"), std::string::npos) << s.message();
  s = JaggedMeta::FromCuSeqlens({1, 5}, &m);
  EXPECT_NE(s.message().find("start at 0"), std::string::npos) << s.message();
  s = JaggedMeta::FromCuSeqlens({0, 5, 4}, &m);
  EXPECT_NE(s.message().find("monotone"), std::string::npos) << s.message();
  s = JaggedMeta::FromLengths({int64_t(1) << 31}, &m);
  EXPECT_NE(s.message().find("int32"), std::string::npos) << s.message();
  s = JaggedMeta::CheckCuSeqlensSf({0, 17}, {0, 17});
  EXPECT_NE(s.message().find("cu_seqlens_sf"), std::string::npos) << s.message();
  EXPECT_EQ(m.batch(), -1);  // nothing was written to `m` by the failed calls
}

TEST(ScaleLayout, BlockedByteFormulas) {
  // byte_in_atom(r, c) = 16 (r mod 32) + 4 floor(r / 32) + c
  EXPECT_EQ(blocked_byte_in_atom(0, 0), 0);
  EXPECT_EQ(blocked_byte_in_atom(1, 0), 16);
  EXPECT_EQ(blocked_byte_in_atom(32, 0), 4);
  EXPECT_EQ(blocked_byte_in_atom(127, 3), 16 * 31 + 4 * 3 + 3);
  // hdim: R = h P + t'; second head of a P=384 batch starts at atom 3.
  EXPECT_EQ(hdim_blocked_offset(1, 0, 0, 384), 512 * 3);
  EXPECT_EQ(hdim_blocked_offset(0, 33, 2, 384), 16 * 1 + 4 * 1 + 2);
  EXPECT_EQ(hdim_blocked_offset(0, 129, 1, 384), 512 + 16 * 1 + 1);
  // seq: atom index h P/128 + g/4
  EXPECT_EQ(seq_blocked_offset(0, 0, 0, 384), 0);
  EXPECT_EQ(seq_blocked_offset(0, 5, 3, 384), 16 * 5 + 3);
  EXPECT_EQ(seq_blocked_offset(0, 37, 4, 384), 512 + 16 * 5 + 4);
  EXPECT_EQ(seq_blocked_offset(2, 127, 11, 384), 512 * (6 + 2) + 16 * 31 + 4 * 3 + 3);
}

}  // namespace
}  // namespace mxflash
