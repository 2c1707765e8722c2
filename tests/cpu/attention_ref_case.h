// A self-contained attention problem for the CPU reference's tests (test_attention_ref.cpp,
// test_attention_causal.cpp): metadata, mask and tensors owned together, the tensors drawn by the
// caller's generator; and one method's forward and backward on it.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "mxflash/attention.h"
#include "reference/attention_ref.h"

namespace mxflash::test {

// Every numeric method of the reference.
inline const ref::AttnMethod kAllAttnMethods[] = {ref::AttnMethod::kFp64, ref::AttnMethod::kBf16,
                                                  ref::AttnMethod::kFp8PerTensor, ref::AttnMethod::kMx};

struct RefCase {
  JaggedMeta qm, km;
  int64_t H = 1;
  bool broadcast = false;
  CausalMask causal = CausalMask::kNone;
  double scale = ref::kDefaultSoftmaxScale;
  std::vector<float> q, k, v, dout;
  ref::AttnProblem problem() const {
    return ref::make_problem(qm, km, H, q.data(), k.data(), v.data(), scale, broadcast, causal);
  }
  int64_t To() const { return ref::out_tokens(problem()); }
  // Pair b (Q sequence, K/V sequence): first Q token, Q length, first output token, first key, keys.
  int64_t q0(int b) const { return broadcast ? 0 : qm.cu_seqlens()[b]; }
  int64_t lq(int b) const { return broadcast ? qm.length(0) : qm.length(b); }
  int64_t o0(int b) const { return broadcast ? b * int64_t(qm.length(0)) : qm.cu_seqlens()[b]; }
  int64_t k0(int b) const { return km.cu_seqlens()[b]; }
  int64_t lk(int b) const { return km.length(b); }
  size_t at(int64_t t, int64_t h) const { return size_t((t * H + h) * kHeadDim); }
};

// gen(n, seed): n values; q, k, v and dout take seeds seed + 1 .. seed + 4.
template <typename Gen>
RefCase make_ref_case(const std::vector<int64_t>& ql, const std::vector<int64_t>& kl, int64_t H, bool broadcast,
                      CausalMask causal, uint64_t seed, Gen gen) {
  RefCase c;
  EXPECT_TRUE(JaggedMeta::FromLengths(ql, &c.qm).ok());
  EXPECT_TRUE(JaggedMeta::FromLengths(kl, &c.km).ok());
  c.H = H;
  c.broadcast = broadcast;
  c.causal = causal;
  c.q = gen(c.qm.total_tokens() * H * kHeadDim, seed + 1);
  c.k = gen(c.km.total_tokens() * H * kHeadDim, seed + 2);
  c.v = gen(c.km.total_tokens() * H * kHeadDim, seed + 3);
  c.dout = gen(c.To() * H * kHeadDim, seed + 4);
  return c;
}

struct RefResult {
  ref::AttnForwardResult f;
  ref::AttnBackwardResult g;
};
inline RefResult run_ref(const RefCase& c, ref::AttnMethod m, const ref::AttnOptions& opt = {}) {
  RefResult r;
  const Status s1 = ref::attention_forward(c.problem(), m, &r.f, opt);
  EXPECT_TRUE(s1.ok()) << s1.message();
  const Status s2 = ref::attention_backward(c.problem(), m, r.f, c.dout.data(), &r.g, opt);
  EXPECT_TRUE(s2.ok()) << s2.message();
  return r;
}

}  // namespace mxflash::test
