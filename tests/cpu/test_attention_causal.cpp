// The causal mask (mxflash::CausalMask, attention.h) in the CPU reference (src/reference/attention_ref)
// and the public CPU paths: the FP64 method against a brute-force masked softmax and finite
// differences, the two alignments' agreement on square sequences, masked keys' and rows' exact
// absence from every method's results (perturbations that must not move a bit, gradients that must
// be exactly zero), the exact-MX one-key rule per row, MX accuracy against FP64 under the mask, and
// attention_forward / attention_backward on CPU tensors with the mask (and a causal value outside
// the enum refused before anything is written).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_host_mx.h"
#include "attention_ref_case.h"
#include "mxflash/attention.h"
#include "mxflash/mx.h"
#include "reference/accuracy_suite.h"
#include "reference/attention_ref.h"

namespace mxflash {
namespace {

using ref::AttnMethod;
constexpr int kD = kHeadDim;
constexpr double kInf = std::numeric_limits<double>::infinity();
const CausalMask kMasks[] = {CausalMask::kTopLeft, CausalMask::kBottomRight};

const char* mask_name(CausalMask m) {
  return m == CausalMask::kNone ? "none" : m == CausalMask::kTopLeft ? "top_left" : "bottom_right";
}

// The mask's rule written out on its own (not through causal_keys): may row i of Lq rows see key j
// of Lk keys?
bool sees(CausalMask m, int64_t i, int64_t j, int64_t lq, int64_t lk) {
  if (m == CausalMask::kTopLeft) return j <= i;
  if (m == CausalMask::kBottomRight) return j - i <= lk - lq;  // the diagonal through (Lq-1, Lk-1)
  return true;
}

std::vector<float> normal(int64_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(n));
  for (float& e : x) e = nd(rng) * scale;
  return x;
}

using Case = test::RefCase;
using Result = test::RefResult;

Case make_case(const std::vector<int64_t>& ql, const std::vector<int64_t>& kl, bool broadcast, CausalMask causal,
               uint32_t seed, int64_t H = 2) {
  return test::make_ref_case(ql, kl, H, broadcast, causal, seed,
                             [](int64_t n, uint64_t s) { return normal(n, uint32_t(s)); });
}

Result run(const Case& c, AttnMethod m, ref::AttnOptions opt = {}) { return test::run_ref(c, m, opt); }

double sqnr(const std::vector<double>& ref, const std::vector<double>& out) {
  return accuracy::compare(ref, out).sqnr_db;
}

// Rows [r0, r1) of pair b of an (To|Tq, H, 128) tensor, all heads; `out_rows`: indexed by output
// token (o0) rather than Q token (q0).
std::vector<double> rows_of(const Case& c, const std::vector<double>& x, int b, int64_t r0, int64_t r1, bool out_rows) {
  std::vector<double> r;
  const int64_t t0 = out_rows ? c.o0(b) : c.q0(b);
  for (int64_t i = r0; i < r1; ++i)
    for (int64_t h = 0; h < c.H; ++h) r.insert(r.end(), x.begin() + c.at(t0 + i, h), x.begin() + c.at(t0 + i, h) + kD);
  return r;
}
std::vector<double> lse_rows(const Case& c, const std::vector<double>& lse, int b, int64_t r0, int64_t r1) {
  std::vector<double> r;
  for (int64_t h = 0; h < c.H; ++h)
    for (int64_t i = r0; i < r1; ++i) r.push_back(lse[size_t(h * c.To() + c.o0(b) + i)]);
  return r;
}
// Keys [j0, j1) of K/V sequence b of a (Tk, H, 128) tensor.
std::vector<double> keys_of(const Case& c, const std::vector<double>& x, int b, int64_t j0, int64_t j1) {
  std::vector<double> r;
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t h = 0; h < c.H; ++h)
      r.insert(r.end(), x.begin() + c.at(c.k0(b) + j, h), x.begin() + c.at(c.k0(b) + j, h) + kD);
  return r;
}

// Reverses the order of tokens [t0, t1) of a (T, H, 128) tensor: every value moves, yet every amax
// over the whole tensor, a sequence or a channel holding the whole range stays the same (per-tensor
// FP8 scales, the Hopper forms' per-(sequence, channel) scales).
void reverse_tokens(std::vector<float>& x, int64_t H, int64_t t0, int64_t t1) {
  const size_t row = size_t(H * kD);
  for (int64_t a = t0, b = t1 - 1; a < b; ++a, --b)
    std::swap_ranges(x.begin() + a * row, x.begin() + (a + 1) * row, x.begin() + b * row);
}

// ------------------------------------------------------------------ (1) FP64 against brute force
// The FP64 forward under each mask against a masked softmax in long double written here: jagged
// lengths 0, 1, 17, 127, 129, 300 with Lq != Lk both ways, and broadcast Q. Rows facing no key:
// out 0 and lse -inf exactly.
TEST(AttentionCausal, Fp64ForwardMatchesBruteForceMaskedSoftmax) {
  struct Shape {
    std::vector<int64_t> ql, kl;
    bool broadcast;
  };
  const Shape shapes[] = {{{1, 17, 127, 129, 300, 0, 40, 5, 300}, {1, 300, 129, 127, 17, 9, 0, 40, 300}, false},
                          {{129}, {0, 1, 17, 127, 129, 300}, true}};
  for (const Shape& sh : shapes)
    for (CausalMask mask : {CausalMask::kNone, CausalMask::kTopLeft, CausalMask::kBottomRight}) {
      SCOPED_TRACE(std::string(mask_name(mask)) + (sh.broadcast ? " broadcast_q" : " jagged"));
      const Case c = make_case(sh.ql, sh.kl, sh.broadcast, mask, 7);
      ref::AttnForwardResult f;
      ASSERT_TRUE(ref::attention_forward(c.problem(), AttnMethod::kFp64, &f).ok());
      const int64_t To = c.To();
      int64_t no_key_rows = 0, partial_rows = 0;
      for (int b = 0; b < c.km.batch(); ++b) {
        const int64_t lq = c.lq(b), lk = c.lk(b);
        for (int64_t h = 0; h < c.H; ++h)
          for (int64_t i = 0; i < lq; ++i) {
            const double* o = f.out.data() + c.at(c.o0(b) + i, h);
            const double lse = f.lse[size_t(h * To + c.o0(b) + i)];
            std::vector<long double> s;
            long double mx = -INFINITY;
            for (int64_t j = 0; j < lk; ++j) {
              if (!sees(mask, i, j, lq, lk)) continue;
              long double acc = 0;
              for (int d = 0; d < kD; ++d)
                acc += (long double)c.q[c.at(c.q0(b) + i, h) + d] * c.k[c.at(c.k0(b) + j, h) + d];
              s.push_back(acc * ref::kDefaultSoftmaxScale);
              mx = std::max(mx, s.back());
            }
            if (s.empty()) {
              ++no_key_rows;
              ASSERT_EQ(lse, -kInf) << "b " << b << " row " << i;
              for (int d = 0; d < kD; ++d) ASSERT_EQ(o[d], 0.0) << "b " << b << " row " << i;
              continue;
            }
            partial_rows += int64_t(s.size()) < lk;
            long double z = 0;
            for (long double& e : s) z += (e = std::exp(e - mx));  // s now holds the weights
            ASSERT_NEAR(lse, double(mx + std::log(z)), 1e-12) << "b " << b << " row " << i;
            long double acc[kD] = {};
            size_t n = 0;
            for (int64_t j = 0; j < lk; ++j) {
              if (!sees(mask, i, j, lq, lk)) continue;
              const long double w = s[n++] / z;
              for (int d = 0; d < kD; ++d) acc[d] += w * c.v[c.at(c.k0(b) + j, h) + d];
            }
            for (int d = 0; d < kD; ++d) ASSERT_NEAR(o[d], double(acc[d]), 1e-12) << "b " << b << " row " << i << " d " << d;
          }
      }
      // The shapes exercise what they should: partial rows under both masks, rows facing no key
      // under bottom_right (Lq > Lk) and for empty K/V sequences.
      if (mask != CausalMask::kNone) EXPECT_GT(partial_rows, 100);
      if (mask == CausalMask::kBottomRight) EXPECT_GT(no_key_rows, 2 * (300 - 17));
    }
}

// dQ, dK, dV of the FP64 backward without a mask and under each mask against central differences
// of L = sum(O . G), rows facing no key and one key and an empty K/V sequence included.
TEST(AttentionCausal, Fp64BackwardMatchesFiniteDifferences) {
  struct Shape {
    std::vector<int64_t> ql, kl;
    bool broadcast;
  };
  const Shape shapes[] = {{{3, 5, 4, 2}, {4, 2, 1, 6}, false}, {{3, 2, 4}, {4, 0, 1}, false}, {{4}, {3, 6}, true}};
  for (const Shape& sh : shapes)
    for (CausalMask mask : {CausalMask::kNone, CausalMask::kTopLeft, CausalMask::kBottomRight}) {
      SCOPED_TRACE(std::string(mask_name(mask)) + (sh.broadcast ? " broadcast_q" : " jagged"));
      Case c = make_case(sh.ql, sh.kl, sh.broadcast, mask, 11, 1);
      for (float& x : c.q) x *= 0.5f;  // softer logits: the finite-difference steps stay linear
      const Result r = run(c, AttnMethod::kFp64);
      auto loss = [&](const Case& cc) {
        ref::AttnForwardResult f;
        EXPECT_TRUE(ref::attention_forward(cc.problem(), AttnMethod::kFp64, &f).ok());
        double l = 0;
        for (size_t i = 0; i < f.out.size(); ++i) l += f.out[i] * cc.dout[i];
        return l;
      };
      std::mt19937 pick(5);
      auto check = [&](std::vector<float> Case::*tensor, const std::vector<double>& grad, const char* name) {
        const size_t n = (c.*tensor).size();
        for (int trial = 0; trial < 48; ++trial) {
          // Every 128th element in turn covers each token, the others at random.
          const size_t i = trial < int(n / kD) ? size_t(trial) * kD + size_t(trial % kD) : size_t(pick() % n);
          Case plus = c, minus = c;
          const float x = (c.*tensor)[i];
          (plus.*tensor)[i] = x + 1e-2f;
          (minus.*tensor)[i] = x - 1e-2f;
          const double h2 = double((plus.*tensor)[i]) - double((minus.*tensor)[i]);
          const double fd = (loss(plus) - loss(minus)) / h2;
          EXPECT_NEAR(grad[i], fd, 2e-5 + 2e-4 * std::fabs(fd)) << name << "[" << i << "]";
        }
      };
      check(&Case::q, r.g.dq, "dq");
      check(&Case::k, r.g.dk, "dk");
      check(&Case::v, r.g.dv, "dv");
    }
}

// ------------------------------------------------ (2) the two alignments agree where Lq == Lk
TEST(AttentionCausal, TopLeftEqualsBottomRightOnSquareSequences) {
  struct Shape {
    std::vector<int64_t> ql, kl;
    bool broadcast;
  };
  const Shape shapes[] = {{{0, 1, 17, 127, 129, 300}, {0, 1, 17, 127, 129, 300}, false},
                          {{129}, {129, 129}, true}};
  for (const Shape& sh : shapes) {
    SCOPED_TRACE(sh.broadcast ? "broadcast_q" : "jagged");
    Case tl = make_case(sh.ql, sh.kl, sh.broadcast, CausalMask::kTopLeft, 13);
    Case br = tl, none = tl;
    br.causal = CausalMask::kBottomRight;
    none.causal = CausalMask::kNone;
    for (AttnMethod m : test::kAllAttnMethods) {
      SCOPED_TRACE(ref::to_string(m));
      const Result a = run(tl, m), b = run(br, m);
      EXPECT_EQ(a.f.out, b.f.out);
      EXPECT_EQ(a.f.lse, b.f.lse);
      EXPECT_EQ(a.g.dq, b.g.dq);
      EXPECT_EQ(a.g.dk, b.g.dk);
      EXPECT_EQ(a.g.dv, b.g.dv);
      const Result n = run(none, m);
      EXPECT_NE(a.f.out, n.f.out) << "the mask must change the result";
      EXPECT_NE(a.g.dk, n.g.dk) << "the mask must change the result";
    }
  }
  // Where Lq != Lk the alignments differ.
  const Case tl = make_case({40}, {70}, false, CausalMask::kTopLeft, 14);
  Case br = tl;
  br.causal = CausalMask::kBottomRight;
  EXPECT_NE(run(tl, AttnMethod::kMx).f.out, run(br, AttnMethod::kMx).f.out);
}

// ------------------------------------------- (3) masked keys and rows contribute exactly nothing
// The reference's variants whose results a mask must not let masked values reach.
struct Variant {
  const char* name;
  AttnMethod m;
  ref::AttnOptions opt;
  bool backward_per_row;  // dQ of a row depends only on what it sees (per-tensor FP8: dS's amax is global)
};
std::vector<Variant> variants() {
  std::vector<Variant> v;
  for (AttnMethod m : test::kAllAttnMethods) v.push_back({ref::to_string(m), m, {}, m != AttnMethod::kFp8PerTensor});
  ref::AttnOptions o;
  o.hopper_exec = true;
  o.hopper_fwd = ref::HopperFwd::kVPerSequenceChannel;
  v.push_back({"mx hopper_exec + V per (sequence, channel)", AttnMethod::kMx, o, true});
  o = {};
  o.hopper_fwd = ref::HopperFwd::kVPerTile;
  o.dynamic_p = true;
  o.dq_fp16_scale_log2 = 4;  // rows with few keys have dS up to |dP| ~ 10: 2^12 would overflow fp16
  v.push_back({"mx V per tile + dynamic P + fp16 dQ", AttnMethod::kMx, o, true});
  return v;
}

// Rows that do not see keys >= 128 (top_left: rows < 128; bottom_right with Lk - Lq = 64: rows < 64)
// keep every bit of out, lse and dQ when those keys' K and V are reordered (every method, Hopper
// forms included: the keys >= 128 fill whole 32-blocks and 128-key tiles, and reordering keeps the
// per-tensor and per-(sequence, channel) amaxes), and, for the methods without a global scale, when
// they are overwritten with huge values and NaN. The rows that see them do change.
TEST(AttentionCausal, MaskedKeysCannotReachOtherRows) {
  for (CausalMask mask : kMasks) {
    SCOPED_TRACE(mask_name(mask));
    const Case c = make_case({200, 50}, {264, 30}, false, mask, 17);
    const int64_t rows = mask == CausalMask::kTopLeft ? 128 : 64;  // rows that see keys < 128 only
    Case reordered = c, wild = c;
    reverse_tokens(reordered.k, c.H, 128, 264);
    reverse_tokens(reordered.v, c.H, 128, 264);
    for (int64_t j = 128; j < 264; ++j)
      for (int64_t h = 0; h < c.H; ++h)
        for (int d = 0; d < kD; ++d) {
          wild.k[c.at(j, h) + d] = (j + d) % 7 == 0 ? NAN : 3e4f;
          wild.v[c.at(j, h) + d] = (j * 3 + d) % 5 == 0 ? NAN : -2e30f;
        }
    for (const Variant& var : variants()) {
      SCOPED_TRACE(var.name);
      const Result a = run(c, var.m, var.opt);
      const bool scales_see_values = var.m == AttnMethod::kFp8PerTensor || var.opt.hopper_exec ||
                               var.opt.hopper_fwd != ref::HopperFwd::kNone;
      for (const Case* p : {&reordered, &wild}) {
        if (p == &wild && scales_see_values) continue;  // global or per-channel scales see the values
        const Result r = run(*p, var.m, var.opt);
        EXPECT_EQ(rows_of(c, a.f.out, 0, 0, rows, true), rows_of(c, r.f.out, 0, 0, rows, true));
        EXPECT_EQ(lse_rows(c, a.f.lse, 0, 0, rows), lse_rows(c, r.f.lse, 0, 0, rows));
        if (var.backward_per_row) EXPECT_EQ(rows_of(c, a.g.dq, 0, 0, rows, false), rows_of(c, r.g.dq, 0, 0, rows, false));
        // Sequence 1 is another sequence: untouched either way.
        EXPECT_EQ(rows_of(c, a.f.out, 1, 0, 50, true), rows_of(c, r.f.out, 1, 0, 50, true));
        if (var.backward_per_row) EXPECT_EQ(keys_of(c, a.g.dk, 1, 0, 30), keys_of(c, r.g.dk, 1, 0, 30));
        EXPECT_NE(rows_of(c, a.f.out, 0, rows, 200, true), rows_of(c, r.f.out, 0, rows, 200, true))
            << "the perturbation must be visible to the rows that see those keys";
      }
    }
  }
}

// dK and dV of keys that only later rows see (top_left: keys >= 64; bottom_right with Lk - Lq = 64:
// keys >= 128, seen by rows >= 64) keep every bit when Q and dO of rows < 64 are reordered: masked
// (row, key) pairs add nothing to a key's gradients. Their other keys' dK and the rows' dQ change.
TEST(AttentionCausal, EarlierRowsCannotReachLaterKeysGradients) {
  for (CausalMask mask : kMasks) {
    SCOPED_TRACE(mask_name(mask));
    const Case c = make_case({200}, {mask == CausalMask::kTopLeft ? 200 : 264}, false, mask, 19);
    const int64_t first_key = mask == CausalMask::kTopLeft ? 64 : 128, lk = c.lk(0);
    Case p = c;
    reverse_tokens(p.q, c.H, 0, 64);
    reverse_tokens(p.dout, c.H, 0, 64);
    for (const Variant& var : variants()) {
      if (!var.backward_per_row) continue;  // per-tensor FP8: dS's scale spans every row
      SCOPED_TRACE(var.name);
      const Result a = run(c, var.m, var.opt), r = run(p, var.m, var.opt);
      EXPECT_EQ(keys_of(c, a.g.dk, 0, first_key, lk), keys_of(c, r.g.dk, 0, first_key, lk));
      EXPECT_EQ(keys_of(c, a.g.dv, 0, first_key, lk), keys_of(c, r.g.dv, 0, first_key, lk));
      EXPECT_NE(keys_of(c, a.g.dk, 0, 0, first_key), keys_of(c, r.g.dk, 0, 0, first_key));
      EXPECT_NE(rows_of(c, a.g.dq, 0, 0, 64, false), rows_of(c, r.g.dq, 0, 0, 64, false));
    }
  }
}

// top_left with Lq < Lk: keys >= Lq are seen by no row and get dK = dV = 0 exactly; bottom_right
// with Lq > Lk: rows < Lq - Lk face no key and get out = 0, lse = -inf, dQ = 0 exactly. Every
// method and form.
TEST(AttentionCausal, UnseenKeysAndRowsGetExactZeros) {
  for (const bool bcast : {false, true}) {
    SCOPED_TRACE(bcast ? "broadcast_q" : "jagged");
    const Case tl = bcast ? make_case({40}, {300, 1, 0, 90}, true, CausalMask::kTopLeft, 23)
                          : make_case({40, 10}, {300, 100}, false, CausalMask::kTopLeft, 23);
    for (const Variant& var : variants()) {
      SCOPED_TRACE(var.name);
      const Result r = run(tl, var.m, var.opt);
      for (int b = 0; b < tl.km.batch(); ++b) {
        if (tl.lk(b) <= tl.lq(b)) continue;
        const std::vector<double> dk = keys_of(tl, r.g.dk, b, tl.lq(b), tl.lk(b));
        const std::vector<double> dv = keys_of(tl, r.g.dv, b, tl.lq(b), tl.lk(b));
        EXPECT_TRUE(std::all_of(dk.begin(), dk.end(), [](double x) { return x == 0.0; })) << "dK, sequence " << b;
        EXPECT_TRUE(std::all_of(dv.begin(), dv.end(), [](double x) { return x == 0.0; })) << "dV, sequence " << b;
        const std::vector<double> seen = keys_of(tl, r.g.dv, b, 0, tl.lq(b));
        EXPECT_TRUE(std::any_of(seen.begin(), seen.end(), [](double x) { return x != 0.0; }));
      }
    }
  }
  const Case br = make_case({300, 10}, {40, 100}, false, CausalMask::kBottomRight, 29);
  for (const Variant& var : variants()) {
    SCOPED_TRACE(var.name);
    const Result r = run(br, var.m, var.opt);
    const std::vector<double> out = rows_of(br, r.f.out, 0, 0, 260, true), dq = rows_of(br, r.g.dq, 0, 0, 260, false);
    const std::vector<double> lse = lse_rows(br, r.f.lse, 0, 0, 260);
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](double x) { return x == 0.0; }));
    EXPECT_TRUE(std::all_of(dq.begin(), dq.end(), [](double x) { return x == 0.0; }));
    EXPECT_TRUE(std::all_of(lse.begin(), lse.end(), [](double x) { return x == -kInf; }));
    const std::vector<double> rest = rows_of(br, r.g.dq, 0, 260, 300, false);
    EXPECT_TRUE(std::any_of(rest.begin(), rest.end(), [](double x) { return x != 0.0; }));
    const std::vector<double> lse_rest = lse_rows(br, r.f.lse, 0, 260, 300);
    EXPECT_TRUE(std::all_of(lse_rest.begin(), lse_rest.end(), [](double x) { return std::isfinite(x); }));
  }
}

// The exact-MX one-key rule per row: a row facing exactly one key (top_left row 0; bottom_right row
// Lq - Lk when Lq > Lk) has dS = 0 exactly, so its dQ is 0; the next row's is not. Per-tensor FP8
// has no such rule, and its row-0 dQ is not 0: the rule is what zeroes it, not cancellation.
TEST(AttentionCausal, MxRowFacingOneKeyGetsZeroDs) {
  for (CausalMask mask : kMasks) {
    SCOPED_TRACE(mask_name(mask));
    const Case c = mask == CausalMask::kTopLeft ? make_case({70, 33}, {90, 33}, false, mask, 31)
                                                : make_case({100, 33}, {40, 33}, false, mask, 31);
    const int64_t one = mask == CausalMask::kTopLeft ? 0 : 60;  // row 0 / row Lq - Lk of sequence 0
    for (const Variant& var : variants()) {
      if (var.m != AttnMethod::kMx && var.m != AttnMethod::kFp8PerTensor) continue;
      SCOPED_TRACE(var.name);
      const Result r = run(c, var.m, var.opt);
      for (int b = 0; b < 2; ++b) {
        const int64_t row = b == 0 ? one : 0;  // sequence 1 is square: row 0 sees one key either way
        const std::vector<double> dq = rows_of(c, r.g.dq, b, row, row + 1, false);
        const std::vector<double> next = rows_of(c, r.g.dq, b, row + 1, row + 2, false);
        const bool zero = std::all_of(dq.begin(), dq.end(), [](double x) { return x == 0.0; });
        if (var.m == AttnMethod::kMx)
          EXPECT_TRUE(zero) << "sequence " << b << " row " << row;
        else
          EXPECT_FALSE(zero) << "sequence " << b << " row " << row;
        EXPECT_TRUE(std::any_of(next.begin(), next.end(), [](double x) { return x != 0.0; }));
      }
    }
  }
}

// ----------------------------------------------- (4) MX against FP64 under the mask (SQNR bands)
// The exact-MX method (and its Hopper forms) with each mask tracks the FP64 reference with the same
// mask about as well as without a mask (~25 / 23.5 dB on normal inputs), and far better than it
// tracks the FP64 result of the other alignment or of no mask.
TEST(AttentionCausal, MxTracksFp64UnderTheMask) {
  struct Shape {
    std::vector<int64_t> ql, kl;
    bool broadcast;
  };
  const Shape shapes[] = {{{200, 300, 77}, {300, 200, 77}, false}, {{150}, {300, 90, 150}, true}};
  for (const Shape& sh : shapes)
    for (CausalMask mask : kMasks) {
      SCOPED_TRACE(std::string(mask_name(mask)) + (sh.broadcast ? " broadcast_q" : " jagged"));
      const Case c = make_case(sh.ql, sh.kl, sh.broadcast, mask, 37);
      Case other = c;
      other.causal = mask == CausalMask::kTopLeft ? CausalMask::kBottomRight : CausalMask::kTopLeft;
      const Result f64 = run(c, AttnMethod::kFp64), wrong = run(other, AttnMethod::kFp64);
      for (const Variant& var : variants()) {
        if (var.m != AttnMethod::kMx) continue;
        SCOPED_TRACE(var.name);
        const Result mx = run(c, var.m, var.opt);
        const double o = sqnr(f64.f.out, mx.f.out), dq = sqnr(f64.g.dq, mx.g.dq), dk = sqnr(f64.g.dk, mx.g.dk),
                     dv = sqnr(f64.g.dv, mx.g.dv);
        std::printf("    %s %s %s: SQNR vs fp64 out %.2f dQ %.2f dK %.2f dV %.2f dB\n", mask_name(mask),
                    sh.broadcast ? "broadcast" : "jagged", var.name, o, dq, dk, dv);
        EXPECT_GT(o, 22.0);
        EXPECT_GT(dq, 20.0);
        EXPECT_GT(dk, 20.0);
        EXPECT_GT(dv, 22.0);
        EXPECT_LT(sqnr(wrong.f.out, mx.f.out), o - 10.0);
        EXPECT_LT(sqnr(wrong.g.dk, mx.g.dk), dk - 10.0);
        // The lse: -inf exactly where FP64's is (no mismatched non-finite pair), close elsewhere.
        const accuracy::ErrorStats l = accuracy::compare(f64.f.lse, mx.f.lse);
        EXPECT_EQ(l.mismatched, 0);
        EXPECT_GT(l.sqnr_db, 30.0);
      }
    }
}

// The reference checks the mask value like its other arguments.
TEST(AttentionCausal, ReferenceRejectsUnknownMask) {
  Case c = make_case({4}, {5}, false, CausalMask(3), 41, 1);
  ref::AttnForwardResult f;
  Status st = ref::attention_forward(c.problem(), AttnMethod::kMx, &f);
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.message().rfind("causal", 0), 0u) << st.message();
  c.causal = CausalMask::kNone;
  ASSERT_TRUE(ref::attention_forward(c.problem(), AttnMethod::kMx, &f).ok());
  c.causal = CausalMask(-1);
  ref::AttnBackwardResult g;
  st = ref::attention_backward(c.problem(), AttnMethod::kMx, f, c.dout.data(), &g);
  EXPECT_EQ(st.message().rfind("causal", 0), 0u) << st.message();
}

// The accuracy suite's --causal: parsed (a bare --causal is top_left), carried by the shapes and
// inputs into every method and the FP64 reference (its numbers are those of the reference with the
// mask), handed to the gpu hook through Inputs::causal, and written to the JSON.
TEST(AttentionCausal, AccuracySuiteRunsWithTheMask) {
  using accuracy::Config;
  bool help = false;
  Config cfg;
  ASSERT_TRUE(accuracy::parse_args({"--causal"}, &cfg, &help).ok());
  EXPECT_EQ(cfg.causal, CausalMask::kTopLeft);
  cfg = {};
  ASSERT_TRUE(accuracy::parse_args({"--causal", "--heads", "3"}, &cfg, &help).ok());
  EXPECT_EQ(cfg.causal, CausalMask::kTopLeft);
  EXPECT_EQ(cfg.heads, 3);
  cfg = {};
  ASSERT_TRUE(accuracy::parse_args({"--causal", "bottom_right"}, &cfg, &help).ok());
  EXPECT_EQ(cfg.causal, CausalMask::kBottomRight);
  ASSERT_TRUE(accuracy::parse_args({"--causal=none"}, &cfg, &help).ok());
  EXPECT_EQ(cfg.causal, CausalMask::kNone);
  const Status bad = accuracy::parse_args({"--causal", "diagonal"}, &cfg, &help);
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.message().rfind("--causal", 0), 0u) << bad.message();

  cfg = {};
  cfg.dists = {accuracy::Dist::kNormal};
  cfg.lengths = {70};
  cfg.lq = 40;
  cfg.heads = 1;
  cfg.threads = 2;
  cfg.causal = CausalMask::kBottomRight;
  cfg.methods = {accuracy::Method::kMx, accuracy::Method::kGpu};
  CausalMask seen = CausalMask::kNone;
  cfg.gpu_forward = [&](const accuracy::Inputs& in, std::vector<double>* out, std::vector<double>* lse) {
    seen = in.causal;
    ref::AttnForwardResult r;
    MXFLASH_RETURN_IF_ERROR(ref::attention_forward(in.problem(), AttnMethod::kMx, &r));
    *out = r.out;
    *lse = r.lse;
    return Status::Ok();
  };
  std::vector<accuracy::Record> records;
  ASSERT_TRUE(accuracy::run_suite(cfg, &records, nullptr).ok());
  EXPECT_EQ(seen, CausalMask::kBottomRight);
  // The suite's inputs, rebuilt: its mx column is the reference with the mask against FP64 with it.
  accuracy::Inputs in;
  ASSERT_TRUE(accuracy::make_inputs(accuracy::Dist::kNormal, accuracy::shape_for(accuracy::Dist::kNormal, cfg), 1,
                                    cfg.seed, &in)
                  .ok());
  EXPECT_EQ(in.causal, CausalMask::kBottomRight);
  EXPECT_EQ(in.problem().causal, CausalMask::kBottomRight);
  ref::AttnForwardResult f64, mx;
  ASSERT_TRUE(ref::attention_forward(in.problem(), AttnMethod::kFp64, &f64).ok());
  ASSERT_TRUE(ref::attention_forward(in.problem(), AttnMethod::kMx, &mx).ok());
  int found = 0;
  for (const accuracy::Record& r : records)
    if (r.tensor == accuracy::Tensor::kOut) {
      EXPECT_DOUBLE_EQ(r.stats.sqnr_db, sqnr(f64.out, mx.out)) << accuracy::to_string(r.method);
      ++found;
    }
  EXPECT_EQ(found, 2);
  EXPECT_NE(accuracy::to_json(cfg, records).find("\"causal\": \"bottom_right\""), std::string::npos);
}

// ------------------------------------------------------------- (5) the public API on CPU tensors
using test::HostMx;
using test::kPoison;
using test::quantize_host;
using test::to_bf16_bits;
using test::bf16_values;

bool poisoned(const void* p, size_t bytes) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  return std::all_of(b, b + bytes, [](uint8_t x) { return x == kPoison; });
}

// Inputs, their MX tensors in every orientation the calls take, and poisoned outputs.
class AttentionCausalApi : public ::testing::Test {
 protected:
  static constexpr int64_t H = 2;
  void build(const std::vector<int64_t>& lq, const std::vector<int64_t>& lk, bool broadcast, CausalMask causal) {
    c = make_case(lq, lk, broadcast, causal, 43, H);
    c.scale = double(float(ref::kDefaultSoftmaxScale));  // the public calls' default, an fp32 value
    for (float& x : c.q) x *= 0.5f;
    for (float& x : c.dout) x = bf16_to_float(float_to_bf16(x));  // dO arrives in bf16
    q = quantize_host(c.q, c.qm, H, Orientation::kHdim);
    q_seq = quantize_host(c.q, c.qm, H, Orientation::kSeq);
    k = quantize_host(c.k, c.km, H, Orientation::kHdim);
    k_seq = quantize_host(c.k, c.km, H, Orientation::kSeq);
    v_seq = quantize_host(c.v, c.km, H, Orientation::kSeq);
    v_hdim = quantize_host(c.v, c.km, H, Orientation::kHdim);
    poison();
  }
  void poison() {
    out.assign(size_t(c.To() * H * kD), uint16_t(kPoison * 0x101));
    lse.assign(size_t(H * c.To()), 0.f);
    std::memset(lse.data(), kPoison, lse.size() * 4);
    dq.assign(size_t(c.qm.total_tokens() * H * kD), uint16_t(kPoison * 0x101));
    dk.assign(size_t(c.km.total_tokens() * H * kD), uint16_t(kPoison * 0x101));
    dv.assign(dk.size(), uint16_t(kPoison * 0x101));
  }
  bool untouched() const {
    return poisoned(out.data(), out.size() * 2) && poisoned(lse.data(), lse.size() * 4) &&
           poisoned(dq.data(), dq.size() * 2) && poisoned(dk.data(), dk.size() * 2) && poisoned(dv.data(), dv.size() * 2);
  }
  TensorView bf16(std::vector<uint16_t>& b, int64_t T) {
    return make_view(b.data(), DType::kBFloat16, Device::kCPU, {T, H, kD});
  }
  TensorView out_view() { return bf16(out, c.To()); }
  TensorView lse_view() { return make_view(lse.data(), DType::kFloat32, Device::kCPU, {H, c.To()}); }
  TensorView x(std::vector<float>& v, const JaggedMeta& m) {
    return make_view(v.data(), DType::kFloat32, Device::kCPU, {m.total_tokens(), H, kD});
  }
  AttentionOptions fwd_options() const {
    AttentionOptions o;
    o.broadcast_q = c.broadcast;
    o.causal = c.causal;
    return o;
  }
  AttentionBackwardOptions bwd_options() const {
    AttentionBackwardOptions o;
    o.broadcast_q = c.broadcast;
    o.causal = c.causal;
    return o;
  }
  Status forward(const AttentionOptions& o) {
    return attention_forward(q.t, k.t, v_seq.t, c.qm, c.km, o, out_view(), lse_view());
  }
  // The backward on MX tensors; out, dout, lse from the given forward result.
  Status backward(const ref::AttnForwardResult& f, const AttentionBackwardOptions& o) {
    fwd_bits = to_bf16_bits(f.out);
    dout_bits.resize(c.dout.size());
    for (size_t i = 0; i < c.dout.size(); ++i) dout_bits[i] = float_to_bf16(c.dout[i]);
    lse_in.assign(f.lse.begin(), f.lse.end());
    return attention_backward(q.t, q_seq.t, k.t, k_seq.t, v_hdim.t, bf16(fwd_bits, c.To()), bf16(dout_bits, c.To()),
                              make_view(lse_in.data(), DType::kFloat32, Device::kCPU, {H, c.To()}), c.qm, c.km, o,
                              bf16(dq, c.qm.total_tokens()), bf16(dk, c.km.total_tokens()),
                              bf16(dv, c.km.total_tokens()));
  }
  Status backward_operands(const AttentionBwdOperands& ops, const AttentionBackwardOptions& o) {
    return attention_backward(ops, bf16(fwd_bits, c.To()), bf16(dout_bits, c.To()),
                              make_view(lse_in.data(), DType::kFloat32, Device::kCPU, {H, c.To()}), c.qm, c.km, o,
                              bf16(dq, c.qm.total_tokens()), bf16(dk, c.km.total_tokens()),
                              bf16(dv, c.km.total_tokens()));
  }

  Case c;
  HostMx q, q_seq, k, k_seq, v_seq, v_hdim;
  std::vector<uint16_t> out, dq, dk, dv, fwd_bits, dout_bits;
  std::vector<float> lse, lse_in;
};

struct ApiShape {
  std::vector<int64_t> ql, kl;
  bool broadcast;
};
const ApiShape kApiShapes[] = {{{40, 17, 70, 0, 129}, {33, 1, 0, 9, 200}, false}, {{70}, {33, 1, 0, 200}, true}};

// attention_forward and attention_backward on MX tensors with each mask: the reference's exact-MX
// results with the same mask, bit for bit (and not those without the mask).
TEST_F(AttentionCausalApi, MxTensorsEqualReferenceBitForBit) {
  for (const ApiShape& sh : kApiShapes)
    for (CausalMask mask : kMasks) {
      SCOPED_TRACE(std::string(mask_name(mask)) + (sh.broadcast ? " broadcast_q" : " jagged"));
      build(sh.ql, sh.kl, sh.broadcast, mask);
      Status st = forward(fwd_options());
      ASSERT_TRUE(st.ok()) << st.message();
      const Result mx = run(c, AttnMethod::kMx);
      EXPECT_EQ(out, to_bf16_bits(mx.f.out));
      EXPECT_EQ(lse, std::vector<float>(mx.f.lse.begin(), mx.f.lse.end()));
      Case none = c;
      none.causal = CausalMask::kNone;
      const Result unmasked = run(none, AttnMethod::kMx);
      EXPECT_NE(out, to_bf16_bits(unmasked.f.out));

      st = backward(mx.f, bwd_options());
      ASSERT_TRUE(st.ok()) << st.message();
      EXPECT_EQ(dq, to_bf16_bits(mx.g.dq));
      EXPECT_EQ(dk, to_bf16_bits(mx.g.dk));
      EXPECT_EQ(dv, to_bf16_bits(mx.g.dv));
      EXPECT_NE(dk, to_bf16_bits(unmasked.g.dk));
    }
}

// The forward and backward on execution-layout operands with each mask: within 0.5 dB (against
// FP64 with the mask) of the calls on MX tensors, -inf lse rows where those have them, and exact
// zeros for the keys no row sees.
TEST_F(AttentionCausalApi, OperandsFollowTheMask) {
  for (const ApiShape& sh : kApiShapes)
    for (CausalMask mask : kMasks) {
      SCOPED_TRACE(std::string(mask_name(mask)) + (sh.broadcast ? " broadcast_q" : " jagged"));
      build(sh.ql, sh.kl, sh.broadcast, mask);
      const Result f64 = run(c, AttnMethod::kFp64), mx = run(c, AttnMethod::kMx);
      test::HostOperands fo(c.qm, c.km, H);
      Status st = quantize_attention_forward(x(c.q, c.qm), x(c.k, c.km), x(c.v, c.km), c.qm, c.km, fo.ops);
      ASSERT_TRUE(st.ok()) << st.message();
      st = attention_forward(fo.ops, c.qm, c.km, fwd_options(), out_view(), lse_view());
      ASSERT_TRUE(st.ok()) << st.message();
      const double o_mx = sqnr(f64.f.out, mx.f.out), o_ops = sqnr(f64.f.out, bf16_values(out));
      EXPECT_GT(o_ops, o_mx - 0.5);
      for (size_t i = 0; i < lse.size(); ++i) {
        if (std::isinf(mx.f.lse[i])) {
          ASSERT_EQ(lse[i], -INFINITY) << i;
        } else {
          ASSERT_TRUE(std::isfinite(lse[i])) << i;
        }
      }

      test::HostBwdOperands bo(c.qm, c.km, H);
      st = quantize_attention_backward(x(c.q, c.qm), x(c.k, c.km), x(c.v, c.km), c.qm, c.km, bo.ops);
      ASSERT_TRUE(st.ok()) << st.message();
      ASSERT_TRUE(backward(mx.f, bwd_options()).ok());
      const std::vector<uint16_t> dq_mx = dq, dk_mx = dk, dv_mx = dv;
      poison();
      st = backward_operands(bo.ops, bwd_options());
      ASSERT_TRUE(st.ok()) << st.message();
      const struct {
        const char* name;
        const std::vector<uint16_t>&mx, &op;
        const std::vector<double>& ref;
      } grads[] = {{"dQ", dq_mx, dq, f64.g.dq}, {"dK", dk_mx, dk, f64.g.dk}, {"dV", dv_mx, dv, f64.g.dv}};
      for (const auto& g : grads) {
        const double a = sqnr(g.ref, bf16_values(g.mx)), b = sqnr(g.ref, bf16_values(g.op));
        std::printf("    %s %s %s SQNR vs fp64: MX tensors %.2f dB, operands %.2f dB\n", mask_name(mask),
                    sh.broadcast ? "broadcast" : "jagged", g.name, a, b);
        EXPECT_GT(b, a - 0.5) << g.name;
      }
      // Keys no row sees: exactly zero on both paths (top_left where Lk > Lq).
      for (int b = 0; b < c.km.batch(); ++b)
        if (mask == CausalMask::kTopLeft)
          for (int64_t j = c.lq(b); j < c.lk(b); ++j)
            for (int64_t e = 0; e < H * kD; ++e) {
              ASSERT_EQ(bf16_to_float(dk[c.at(c.k0(b) + j, 0) + e]), 0.f);
              ASSERT_EQ(bf16_to_float(dv[c.at(c.k0(b) + j, 0) + e]), 0.f);
            }
    }
}

// opt.causal outside the enum: every entry refuses it with an error naming "causal" before writing
// anything; the workspace queries answer 0 for it.
TEST_F(AttentionCausalApi, UnknownMaskRejectedAndNothingWritten) {
  build({40, 17}, {33, 60}, false, CausalMask::kTopLeft);
  const Result mx = run(c, AttnMethod::kMx);
  test::HostOperands fo(c.qm, c.km, H);
  test::HostBwdOperands bo(c.qm, c.km, H);
  ASSERT_TRUE(quantize_attention_forward(x(c.q, c.qm), x(c.k, c.km), x(c.v, c.km), c.qm, c.km, fo.ops).ok());
  ASSERT_TRUE(quantize_attention_backward(x(c.q, c.qm), x(c.k, c.km), x(c.v, c.km), c.qm, c.km, bo.ops).ok());
  for (const int bad : {3, -1, 77}) {
    SCOPED_TRACE(bad);
    auto expect_rejected = [&](const Status& st, const char* what) {
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << what << ": " << st.message();
      EXPECT_EQ(st.message().rfind("causal", 0), 0u) << what << ": " << st.message();
      EXPECT_TRUE(untouched()) << what << ": outputs were written by a rejected call";
    };
    AttentionOptions fo_opt = fwd_options();
    fo_opt.causal = CausalMask(bad);
    AttentionBackwardOptions bo_opt = bwd_options();
    bo_opt.causal = CausalMask(bad);
    poison();
    expect_rejected(forward(fo_opt), "attention_forward (MX tensors)");
    expect_rejected(attention_forward(fo.ops, c.qm, c.km, fo_opt, out_view(), lse_view()),
                    "attention_forward (operands)");
    expect_rejected(backward(mx.f, bo_opt), "attention_backward (MX tensors)");
    expect_rejected(backward_operands(bo.ops, bo_opt), "attention_backward (operands)");
    EXPECT_EQ(attention_forward_workspace_size(c.qm, c.km, H, fo_opt), 0u);
    EXPECT_EQ(attention_forward_operands_workspace_size(c.qm, c.km, H, fo_opt), 0u);
    EXPECT_EQ(attention_backward_workspace_size(c.qm, c.km, H, bo_opt), 0u);
    EXPECT_EQ(attention_backward_operands_workspace_size(c.qm, c.km, H, bo_opt), 0u);
  }
  // CUDA-tagged tensors (dummy pointers): the launchers refuse the value themselves, before any
  // device check or pointer access (the CPU reference's own check is not on that path).
  auto cuda = [](MxTensor t) {
    t.payload.device = t.scales.device = Device::kCUDA;
    t.payload.data = t.scales.data = test::kDummyDevicePtr;
    return t;
  };
  auto cuda_view = [](TensorView t) {
    t.device = Device::kCUDA;
    t.data = test::kDummyDevicePtr;
    return t;
  };
  AttentionOptions fo_bad = fwd_options();
  fo_bad.causal = CausalMask(5);
  AttentionBackwardOptions bo_bad = bwd_options();
  bo_bad.causal = CausalMask(5);
  auto expect_causal = [](const Status& st, const char* what) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << what << ": " << st.message();
    EXPECT_EQ(st.message().rfind("causal", 0), 0u) << what << ": " << st.message();
  };
  expect_causal(attention_forward(cuda(q.t), cuda(k.t), cuda(v_seq.t), c.qm, c.km, fo_bad, cuda_view(out_view()),
                                  cuda_view(lse_view())),
                "attention_forward (CUDA MX tensors)");
  AttentionFwdOperands fops = fo.ops;
  for (TensorView* t : {&fops.q, &fops.k, &fops.v, &fops.q_scale, &fops.k_scale, &fops.v_scale}) *t = cuda_view(*t);
  expect_causal(attention_forward(fops, c.qm, c.km, fo_bad, cuda_view(out_view()), cuda_view(lse_view())),
                "attention_forward (CUDA operands)");
  const TensorView o_in = cuda_view(bf16(fwd_bits, c.To())), g_in = cuda_view(bf16(dout_bits, c.To()));
  const TensorView l_in = cuda_view(make_view(lse_in.data(), DType::kFloat32, Device::kCPU, {H, c.To()}));
  const TensorView gq = cuda_view(bf16(dq, c.qm.total_tokens())), gk = cuda_view(bf16(dk, c.km.total_tokens())),
                   gv = cuda_view(bf16(dv, c.km.total_tokens()));
  expect_causal(attention_backward(cuda(q.t), cuda(q_seq.t), cuda(k.t), cuda(k_seq.t), cuda(v_hdim.t), o_in, g_in, l_in,
                                   c.qm, c.km, bo_bad, gq, gk, gv),
                "attention_backward (CUDA MX tensors)");
  bo_bad.exact_mx = true;
  expect_causal(attention_backward(cuda(q.t), cuda(q_seq.t), cuda(k.t), cuda(k_seq.t), cuda(v_hdim.t), o_in, g_in, l_in,
                                   c.qm, c.km, bo_bad, gq, gk, gv),
                "attention_backward (CUDA MX tensors, exact_mx)");
  bo_bad.exact_mx = false;
  AttentionBwdOperands bops = bo.ops;
  for (TensorView* t : {&bops.q, &bops.k, &bops.v, &bops.qt, &bops.kt, &bops.q_scale, &bops.k_scale, &bops.v_scale,
                        &bops.qt_scale, &bops.kt_scale})
    *t = cuda_view(*t);
  expect_causal(attention_backward(bops, o_in, g_in, l_in, c.qm, c.km, bo_bad, gq, gk, gv),
                "attention_backward (CUDA operands)");

  // The same calls with the valid mask go through.
  poison();
  EXPECT_TRUE(forward(fwd_options()).ok());
  EXPECT_TRUE(backward(mx.f, bwd_options()).ok());
}

}  // namespace
}  // namespace mxflash
