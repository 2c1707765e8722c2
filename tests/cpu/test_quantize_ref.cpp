// mxflash::quantize / quantize_hdim_seq / dequantize / layout converters on CPU tensors, compared
// byte for byte with a direct implementation written here from REFERENCE.md §2-3 and
// ARCHITECTURE.md §2 (loops over sequences and blocks, the oracle codecs of mx_oracle.h, the §3
// byte formulas), never with the reference's own helpers. Every output is poisoned before each
// call (0xA5, then again 0x5A) and must be fully rewritten, padding included.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "mx_oracle.h"
#include "mxflash/jagged.h"
#include "mxflash/quantize.h"
#include "mxflash/tensor.h"

namespace mxflash {
namespace {

using mxtest::diff_bytes;

constexpr uint8_t kPoisons[] = {0xA5, 0x5A};
constexpr int kD = 128;  // head dim
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------- problem and its data

struct Problem {
  std::vector<int64_t> lengths;
  int64_t H = 1, T = 0, P = 0;
  std::vector<int64_t> cu, sf;  // computed here from the lengths, not taken from JaggedMeta
  JaggedMeta meta;
  bool bf16 = false;
  std::vector<float> vals;  // the values the quantizer sees, (T, H, 128)
  std::vector<float> xf;
  std::vector<uint16_t> xb;

  TensorView x() {
    return bf16 ? make_view(xb.data(), DType::kBFloat16, Device::kCPU, {T, H, kD})
                : make_view(xf.data(), DType::kFloat32, Device::kCPU, {T, H, kD});
  }
  int64_t groups() const { return P / 32; }
};

Problem make_problem(const std::vector<int64_t>& lengths, int64_t H, bool bf16) {
  Problem p;
  p.lengths = lengths;
  p.H = H;
  p.bf16 = bf16;
  p.cu = {0};
  p.sf = {0};
  for (int64_t L : lengths) {
    p.cu.push_back(p.cu.back() + L);
    p.sf.push_back(p.sf.back() + (L + 127) / 128 * 128);
  }
  p.T = p.cu.back();
  p.P = p.sf.back();
  EXPECT_TRUE(JaggedMeta::FromLengths(lengths, &p.meta).ok());
  EXPECT_EQ(p.meta.total_tokens(), p.T);
  EXPECT_EQ(p.meta.padded_tokens(), p.P);
  return p;
}

// Sets the values (fp32, or rounded to bf16 by truncation: any bf16 is a valid input).
void set_values(Problem& p, const std::vector<float>& v) {
  p.xf.clear();
  p.xb.clear();
  p.vals.resize(v.size());
  if (p.bf16) {
    p.xb.resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      p.xb[i] = uint16_t(mxtest::bits_of(v[i]) >> 16);
      p.vals[i] = mxtest::bf16_value(p.xb[i]);
    }
  } else {
    p.xf = v;
    p.vals = v;
  }
}

// Magnitudes vary per (32-token band, head, 32-column band) so both hdim and seq blocks see
// related but spread values; 6% of bands sit near the fp32 subnormal range, 6% near its top;
// some zeros, -0s, exact 448*2^k and tie values, and rare NaN/inf.
std::vector<float> random_values(const Problem& p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> pct(0, 99);
  std::uniform_real_distribution<double> frac(0.0, 1.0);
  const int64_t bands = (p.T + 31) / 32 + 1;
  std::vector<int> base(size_t(bands * p.H * 4));
  for (int& b : base) {
    const int r = pct(rng);
    b = r < 88 ? std::uniform_int_distribution<int>(-20, 20)(rng)
               : r < 94 ? std::uniform_int_distribution<int>(-150, -112)(rng)
                        : std::uniform_int_distribution<int>(100, 120)(rng);
  }
  std::vector<float> v(size_t(p.T * p.H * kD));
  for (int64_t t = 0; t < p.T; ++t)
    for (int64_t h = 0; h < p.H; ++h)
      for (int d = 0; d < kD; ++d) {
        const int e = base[size_t(((t / 32) * p.H + h) * 4 + d / 32)] - int(rng() % 7);
        const bool neg = rng() & 1;
        float x;
        const uint64_t r = rng() % 100000;
        if (r < 1500) x = 0.f;
        else if (r < 2000) x = float(std::ldexp(448.0, e - 8));   // exactly 448 * 2^k
        else if (r < 2500) x = float(std::ldexp(464.0, e - 8));   // a tie at the top
        else if (r < 2503) x = kNaN;
        else if (r < 2505) x = kInf;
        else x = float(std::ldexp(1.0 + frac(rng), e));
        v[size_t((t * p.H + h) * kD + d)] = neg ? -x : x;
      }
  return v;
}

// ---------------------------------------------------------------- direct implementation

// Token-major payload (T, H, 128) and plain scales of one orientation.
struct Expected {
  std::vector<uint8_t> payload, scales;
};

int64_t xi(const Problem& p, int64_t t, int64_t h, int64_t d) { return (t * p.H + h) * kD + d; }

Expected expect_hdim(const Problem& p, ScalingMode mode) {
  Expected e;
  e.payload.assign(size_t(p.T * p.H * kD), 0);
  e.scales.assign(size_t(p.T * p.H * 4), 0);
  for (int64_t t = 0; t < p.T; ++t)
    for (int64_t h = 0; h < p.H; ++h)
      for (int k = 0; k < 4; ++k) {
        const float* v = &p.vals[size_t(xi(p, t, h, 32 * k))];
        const uint8_t s = mxtest::scale_byte(mxtest::block_amax(v, 32), mode);
        e.scales[size_t((t * p.H + h) * 4 + k)] = s;
        for (int i = 0; i < 32; ++i) e.payload[size_t(xi(p, t, h, 32 * k + i))] = mxtest::quant_elem(v[i], s);
      }
  return e;
}

// seq (cols = 1) and square32 (cols = 32): blocks of up to 32 tokens from each sequence start
// (a short tail is a zero-padded block: the zeros change nothing in amax), `cols` columns wide.
// Plain scales (P/32, H, 128/cols); groups without real tokens hold 0.
Expected expect_tok(const Problem& p, ScalingMode mode, int cols) {
  Expected e;
  const int nblk = kD / cols;
  e.payload.assign(size_t(p.T * p.H * kD), 0);
  e.scales.assign(size_t(p.groups() * p.H * nblk), 0);
  std::vector<float> blk;
  for (size_t b = 0; b < p.lengths.size(); ++b) {
    const int64_t L = p.lengths[b];
    for (int64_t j = 0; j * 32 < L; ++j) {
      const int64_t n = std::min<int64_t>(32, L - 32 * j), t0 = p.cu[b] + 32 * j, g = p.sf[b] / 32 + j;
      for (int64_t h = 0; h < p.H; ++h)
        for (int c = 0; c < nblk; ++c) {
          blk.clear();
          for (int64_t i = 0; i < n; ++i)
            for (int dd = 0; dd < cols; ++dd) blk.push_back(p.vals[size_t(xi(p, t0 + i, h, c * cols + dd))]);
          const uint8_t s = mxtest::scale_byte(mxtest::block_amax(blk.data(), int(blk.size())), mode);
          e.scales[size_t((g * p.H + h) * nblk + c)] = s;
          for (int64_t i = 0; i < n; ++i)
            for (int dd = 0; dd < cols; ++dd) {
              const int64_t o = xi(p, t0 + i, h, c * cols + dd);
              e.payload[size_t(o)] = mxtest::quant_elem(p.vals[size_t(o)], s);
            }
        }
    }
  }
  return e;
}

Expected expect(const Problem& p, Orientation o, ScalingMode mode) {
  switch (o) {
    case Orientation::kHdim: return expect_hdim(p, mode);
    case Orientation::kSeq: return expect_tok(p, mode, 1);
    case Orientation::kSquare32: return expect_tok(p, mode, 32);
  }
  return {};
}

// Plain -> blocked128x4 by the REFERENCE.md §3 formulas; bytes no real block maps to stay 0.
// square32's blocked form is the hdim tensor with each token row carrying its block's scale.
std::vector<uint8_t> blocked_from_plain(const Problem& p, Orientation o, const std::vector<uint8_t>& plain) {
  std::vector<uint8_t> out(size_t(4 * p.H * p.P), 0);
  for (size_t b = 0; b < p.lengths.size(); ++b)
    for (int64_t i = 0; i < p.lengths[b]; ++i) {
      const int64_t t = p.cu[b] + i, tp = p.sf[b] + i, g = tp / 32;
      for (int64_t h = 0; h < p.H; ++h) {
        if (o == Orientation::kHdim)
          for (int k = 0; k < 4; ++k)
            out[size_t(mxtest::ref_hdim_blocked(h, tp, k, p.P))] = plain[size_t((t * p.H + h) * 4 + k)];
        else if (o == Orientation::kSquare32)
          for (int k = 0; k < 4; ++k)
            out[size_t(mxtest::ref_hdim_blocked(h, tp, k, p.P))] = plain[size_t((g * p.H + h) * 4 + k)];
        else if (i % 32 == 0)
          for (int d = 0; d < kD; ++d)
            out[size_t(mxtest::ref_seq_blocked(h, d, g, p.P))] = plain[size_t((g * p.H + h) * kD + d)];
      }
    }
  return out;
}

// Blocked -> plain: real blocks read back (square32: from the group's first token row), padding 0.
std::vector<uint8_t> plain_from_blocked(const Problem& p, Orientation o, const std::vector<uint8_t>& blocked) {
  const int64_t n = o == Orientation::kHdim ? p.T * p.H * 4 : p.groups() * p.H * (o == Orientation::kSeq ? kD : 4);
  std::vector<uint8_t> out(size_t(n), 0);
  for (size_t b = 0; b < p.lengths.size(); ++b)
    for (int64_t i = 0; i < p.lengths[b]; ++i) {
      const int64_t t = p.cu[b] + i, tp = p.sf[b] + i, g = tp / 32;
      for (int64_t h = 0; h < p.H; ++h) {
        if (o == Orientation::kHdim)
          for (int k = 0; k < 4; ++k)
            out[size_t((t * p.H + h) * 4 + k)] = blocked[size_t(mxtest::ref_hdim_blocked(h, tp, k, p.P))];
        else if (i % 32 != 0)
          continue;
        else if (o == Orientation::kSquare32)
          for (int k = 0; k < 4; ++k)
            out[size_t((g * p.H + h) * 4 + k)] = blocked[size_t(mxtest::ref_hdim_blocked(h, tp, k, p.P))];
        else
          for (int d = 0; d < kD; ++d)
            out[size_t((g * p.H + h) * kD + d)] = blocked[size_t(mxtest::ref_seq_blocked(h, d, g, p.P))];
      }
    }
  return out;
}

// (T, H, 128) -> (H, 128, P): token t of sequence b at padded index sf[b] + (t - cu[b]); padding 0.
std::vector<uint8_t> token_contiguous(const Problem& p, const std::vector<uint8_t>& tm) {
  std::vector<uint8_t> out(size_t(p.H * kD * p.P), 0);
  for (size_t b = 0; b < p.lengths.size(); ++b)
    for (int64_t i = 0; i < p.lengths[b]; ++i)
      for (int64_t h = 0; h < p.H; ++h)
        for (int d = 0; d < kD; ++d)
          out[size_t((h * kD + d) * p.P + p.sf[b] + i)] = tm[size_t(xi(p, p.cu[b] + i, h, d))];
  return out;
}

// ---------------------------------------------------------------- shapes (written from the docs)

std::vector<int64_t> payload_dims(const Problem& p, PayloadLayout l) {
  if (l == PayloadLayout::kTokenMajor) return {p.T, p.H, kD};
  return {p.H, kD, p.P};
}
std::vector<int64_t> scale_dims(const Problem& p, Orientation o, ScaleLayout l) {
  if (l == ScaleLayout::kBlocked128x4) {
    if (o == Orientation::kSeq) return {p.H * 32, p.P / 8};
    return {p.H * p.P / 4, 16};
  }
  if (o == Orientation::kHdim) return {p.T, p.H, 4};
  if (o == Orientation::kSeq) return {p.P / 32, p.H, kD};
  return {p.P / 32, p.H, 4};
}
int64_t prod(const std::vector<int64_t>& d) {
  int64_t n = 1;
  for (int64_t v : d) n *= v;
  return n;
}

// A poisoned output buffer with its view.
struct Buf {
  std::vector<uint8_t> bytes;
  std::vector<int64_t> dims;
  DType dtype;
  Buf(std::vector<int64_t> d, DType t, uint8_t poison) : bytes(size_t(prod(d)), poison), dims(std::move(d)), dtype(t) {}
  TensorView view() { return make_view(bytes.data(), dtype, Device::kCPU, int(dims.size()), dims.data()); }
};

std::string name_of(Orientation o, const QuantizeOptions& opt) {
  return std::string(to_string(o)) + "/" + to_string(opt.mode) + "/" + to_string(opt.scale_layout) + "/" +
         to_string(opt.payload_layout);
}

// Expected payload and scales in the requested layouts.
std::vector<uint8_t> want_payload(const Problem& p, const Expected& e, PayloadLayout l) {
  return l == PayloadLayout::kTokenMajor ? e.payload : token_contiguous(p, e.payload);
}
std::vector<uint8_t> want_scales(const Problem& p, const Expected& e, Orientation o, ScaleLayout l) {
  return l == ScaleLayout::kPlain ? e.scales : blocked_from_plain(p, o, e.scales);
}

void check_quantize(Problem& p, Orientation o, const QuantizeOptions& opt, const Expected& e) {
  const auto wp = want_payload(p, e, opt.payload_layout);
  const auto ws = want_scales(p, e, o, opt.scale_layout);
  for (uint8_t poison : kPoisons) {
    Buf pay(payload_dims(p, opt.payload_layout), DType::kE4M3, poison);
    Buf sc(scale_dims(p, o, opt.scale_layout), DType::kE8M0, poison);
    const Status st = quantize(p.x(), p.meta, o, opt, pay.view(), sc.view());
    ASSERT_TRUE(st.ok()) << name_of(o, opt) << ": " << st.message();
    EXPECT_EQ(diff_bytes(wp, pay.bytes.data(), pay.bytes.size()), "") << name_of(o, opt) << " payload, poison " << int(poison);
    EXPECT_EQ(diff_bytes(ws, sc.bytes.data(), sc.bytes.size()), "") << name_of(o, opt) << " scales, poison " << int(poison);
  }
}

// ---------------------------------------------------------------- random jagged batches

struct BatchCase {
  std::vector<int64_t> lengths;
  int64_t H;
};

std::vector<BatchCase> batch_cases() {
  std::vector<BatchCase> cases = {
      {{0, 1, 31, 32, 33, 127, 128, 129}, 3},
      {{1000, 0, 33}, 1},
      {{129, 31, 128, 1, 0}, 16},
      {{1000}, 3},
      {{0}, 3},  // empty batch: nothing to write
  };
  // Random batches from the hostile length set (seeded), kept small enough for a fast suite.
  const int64_t pool[] = {0, 1, 31, 32, 33, 127, 128, 129, 1000};
  const int64_t heads[] = {1, 3, 16};
  std::mt19937_64 rng(11);
  while (cases.size() < 9) {
    BatchCase c;
    c.H = heads[rng() % 3];
    const int B = 1 + int(rng() % 6);
    int64_t T = 0;
    for (int b = 0; b < B; ++b) {
      c.lengths.push_back(pool[rng() % 9]);
      T += c.lengths.back();
    }
    if (T * c.H <= 3000) cases.push_back(c);
  }
  return cases;
}

struct RandomParam {
  int case_index;
  bool bf16;
  ScalingMode mode;
};

class QuantizeRandom : public ::testing::TestWithParam<RandomParam> {};

TEST_P(QuantizeRandom, MatchesDirectImplementationInEveryLayout) {
  const RandomParam prm = GetParam();
  const BatchCase bc = batch_cases()[size_t(prm.case_index)];
  Problem p = make_problem(bc.lengths, bc.H, prm.bf16);
  set_values(p, random_values(p, 100 + uint64_t(prm.case_index)));
  SCOPED_TRACE("T=" + std::to_string(p.T) + " P=" + std::to_string(p.P) + " H=" + std::to_string(p.H));

  Expected e[3];
  for (Orientation o : {Orientation::kHdim, Orientation::kSeq, Orientation::kSquare32}) {
    e[int(o)] = expect(p, o, prm.mode);
    for (ScaleLayout sl : {ScaleLayout::kPlain, ScaleLayout::kBlocked128x4})
      for (PayloadLayout pl : {PayloadLayout::kTokenMajor, PayloadLayout::kTokenContiguous}) {
        if (o == Orientation::kHdim && pl != PayloadLayout::kTokenMajor) continue;
        check_quantize(p, o, QuantizeOptions{prm.mode, sl, pl}, e[int(o)]);
      }
  }

  // quantize_hdim_seq writes exactly what separate hdim and seq calls write.
  for (ScaleLayout sl : {ScaleLayout::kPlain, ScaleLayout::kBlocked128x4})
    for (PayloadLayout pl : {PayloadLayout::kTokenMajor, PayloadLayout::kTokenContiguous}) {
      const QuantizeOptions opt{prm.mode, sl, pl};
      for (uint8_t poison : kPoisons) {
        Buf ph(payload_dims(p, PayloadLayout::kTokenMajor), DType::kE4M3, poison);
        Buf sh(scale_dims(p, Orientation::kHdim, sl), DType::kE8M0, poison);
        Buf ps(payload_dims(p, pl), DType::kE4M3, poison);
        Buf ss(scale_dims(p, Orientation::kSeq, sl), DType::kE8M0, poison);
        const Status st = quantize_hdim_seq(p.x(), p.meta, opt, ph.view(), sh.view(), ps.view(), ss.view());
        ASSERT_TRUE(st.ok()) << st.message();
        const std::string what = "hdim_seq " + name_of(Orientation::kSeq, opt) + " poison " + std::to_string(poison);
        const Expected& eh = e[int(Orientation::kHdim)];
        const Expected& es = e[int(Orientation::kSeq)];
        EXPECT_EQ(diff_bytes(eh.payload, ph.bytes.data(), ph.bytes.size()), "") << what;
        EXPECT_EQ(diff_bytes(want_scales(p, eh, Orientation::kHdim, sl), sh.bytes.data(), sh.bytes.size()), "") << what;
        EXPECT_EQ(diff_bytes(want_payload(p, es, pl), ps.bytes.data(), ps.bytes.size()), "") << what;
        EXPECT_EQ(diff_bytes(want_scales(p, es, Orientation::kSeq, sl), ss.bytes.data(), ss.bytes.size()), "") << what;
      }
    }
}

std::vector<RandomParam> random_params() {
  std::vector<RandomParam> v;
  for (int c = 0; c < int(batch_cases().size()); ++c)
    for (bool bf16 : {false, true})
      for (ScalingMode m : {ScalingMode::kRceil, ScalingMode::kFloor}) v.push_back({c, bf16, m});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Batches, QuantizeRandom, ::testing::ValuesIn(random_params()),
                         [](const ::testing::TestParamInfo<RandomParam>& i) {
                           return "case" + std::to_string(i.param.case_index) + (i.param.bf16 ? "_bf16_" : "_fp32_") +
                                  to_string(i.param.mode);
                         });

// ---------------------------------------------------------------- REFERENCE.md §3 example

// H = 16, lengths [17, 0, 129]: cu_seqlens [0,17,17,146], cu_seqlens_sf [0,128,128,384]; hdim
// blocked scales (1536, 16), seq blocked scales (512, 48). A few blocks get a known amax
// 448 * 2^j (RCEIL byte 127 + j), all else is zero: those bytes sit at hand-computed addresses,
// every other byte (other blocks and padding) is 0.
TEST(QuantizeReferenceExample, HdimBlockedBytePositions) {
  Problem p = make_problem({17, 0, 129}, 16, false);
  ASSERT_EQ(p.meta.cu_seqlens(), (std::vector<int32_t>{0, 17, 17, 146}));
  ASSERT_EQ(p.meta.cu_seqlens_sf(), (std::vector<int32_t>{0, 128, 128, 384}));
  std::vector<float> v(size_t(p.T * p.H * kD), 0.f);
  struct Target { int64_t t, h, k; int j; int64_t addr; };
  // addr = 512 floor(R/128) + 16 (R mod 32) + 4 floor((R mod 128)/32) + k, R = h P + t'
  const Target targets[] = {
      {0, 0, 0, 1, 0},            // seq 0 token 0: t' = 0
      {16, 5, 3, 2, 7939},        // seq 0 token 16: R = 5*384 + 16 = 1936 -> 512*15 + 16*16 + 0 + 3
      {145, 15, 2, 3, 24066},     // seq 2 token 128: t' = 256, R = 6016 -> 512*47 + 2
      {50, 1, 1, 4, 2069},        // seq 2 token 33: t' = 161, R = 545 -> 512*4 + 16 + 4 + 1
  };
  for (const Target& g : targets) v[size_t(xi(p, g.t, g.h, 32 * g.k + 7))] = -float(std::ldexp(448.0, g.j));
  set_values(p, v);
  Buf pay({p.T, p.H, kD}, DType::kE4M3, 0xA5);
  Buf sc({1536, 16}, DType::kE8M0, 0xA5);
  const Status st = quantize(p.x(), p.meta, Orientation::kHdim, {ScalingMode::kRceil, ScaleLayout::kBlocked128x4},
                             pay.view(), sc.view());
  ASSERT_TRUE(st.ok()) << st.message();
  std::vector<uint8_t> want(sc.bytes.size(), 0);
  for (const Target& g : targets) want[size_t(g.addr)] = uint8_t(127 + g.j);
  EXPECT_EQ(diff_bytes(want, sc.bytes.data(), sc.bytes.size()), "");
  for (const Target& g : targets) EXPECT_EQ(pay.bytes[size_t(xi(p, g.t, g.h, 32 * g.k + 7))], 0xFE);  // -448
  // Plain layout: (T, H, 4) at (t H + h) 4 + k.
  Buf scp({p.T, p.H, 4}, DType::kE8M0, 0xA5);
  ASSERT_TRUE(quantize(p.x(), p.meta, Orientation::kHdim, {}, pay.view(), scp.view()).ok());
  std::vector<uint8_t> wantp(scp.bytes.size(), 0);
  for (const Target& g : targets) wantp[size_t((g.t * 16 + g.h) * 4 + g.k)] = uint8_t(127 + g.j);
  EXPECT_EQ(diff_bytes(wantp, scp.bytes.data(), scp.bytes.size()), "");
}

TEST(QuantizeReferenceExample, SeqBlockedBytePositions) {
  Problem p = make_problem({17, 0, 129}, 16, true);
  std::vector<float> v(size_t(p.T * p.H * kD), 0.f);
  struct Target { int64_t t, h, d; int j; int64_t addr; };
  // addr = 512 (h P/128 + floor(g/4)) + 16 (d mod 32) + 4 floor(d/32) + (g mod 4), g = t'/32
  const Target targets[] = {
      {3, 0, 0, 1, 0},           // seq 0, t' = 3, g = 0
      {145, 15, 127, 2, 24572},  // seq 2 token 128: t' = 256, g = 8 -> 512*(45+2) + 496 + 12 + 0
      {57, 2, 37, 3, 3669},      // seq 2 token 40: t' = 168, g = 5 -> 512*(6+1) + 80 + 4 + 1
      {16, 7, 64, 4, 10760},     // seq 0 token 16: g = 0 -> 512*21 + 0 + 8 + 0
  };
  for (const Target& g : targets) v[size_t(xi(p, g.t, g.h, g.d))] = float(std::ldexp(448.0, g.j));
  set_values(p, v);
  Buf pay({p.T, p.H, kD}, DType::kUInt8, 0xA5);
  Buf sc({512, 48}, DType::kUInt8, 0xA5);
  const Status st = quantize(p.x(), p.meta, Orientation::kSeq, {ScalingMode::kRceil, ScaleLayout::kBlocked128x4},
                             pay.view(), sc.view());
  ASSERT_TRUE(st.ok()) << st.message();
  std::vector<uint8_t> want(sc.bytes.size(), 0);
  for (const Target& g : targets) want[size_t(g.addr)] = uint8_t(127 + g.j);
  EXPECT_EQ(diff_bytes(want, sc.bytes.data(), sc.bytes.size()), "");
  for (const Target& g : targets) EXPECT_EQ(pay.bytes[size_t(xi(p, g.t, g.h, g.d))], 0x7E);
  // Plain (P/32, H, 128) = (12, 16, 128) at (g H + h) 128 + d: groups 1-3 (seq 0 padding),
  // 9-11 (seq 2 padding) stay 0.
  Buf scp({12, 16, kD}, DType::kUInt8, 0xA5);
  ASSERT_TRUE(quantize(p.x(), p.meta, Orientation::kSeq, {}, pay.view(), scp.view()).ok());
  std::vector<uint8_t> wantp(scp.bytes.size(), 0);
  const int64_t gs[] = {0, 8, 5, 0};
  for (int i = 0; i < 4; ++i) wantp[size_t((gs[i] * 16 + targets[i].h) * kD + targets[i].d)] = uint8_t(127 + targets[i].j);
  EXPECT_EQ(diff_bytes(wantp, scp.bytes.data(), scp.bytes.size()), "");
}

// Token-contiguous seq payload (H, 128, P): byte (h, d, t') with zero padding.
TEST(QuantizeReferenceExample, TokenContiguousPayload) {
  Problem p = make_problem({17, 0, 129}, 16, false);
  std::vector<float> v(size_t(p.T * p.H * kD), 0.f);
  v[size_t(xi(p, 16, 3, 5))] = 1.f;     // seq 0 token 16 -> t' = 16
  v[size_t(xi(p, 17, 3, 5))] = -2.f;    // seq 2 token 0 -> t' = 128
  v[size_t(xi(p, 145, 15, 127))] = 4.f; // seq 2 token 128 -> t' = 256
  set_values(p, v);
  Buf pay({16, kD, 384}, DType::kE4M3, 0xA5);
  Buf sc({12, 16, kD}, DType::kE8M0, 0xA5);
  QuantizeOptions opt;
  opt.mode = ScalingMode::kFloor;  // FLOOR: 1 -> scale 2^-8, payload 256 (0x78)
  opt.payload_layout = PayloadLayout::kTokenContiguous;
  ASSERT_TRUE(quantize(p.x(), p.meta, Orientation::kSeq, opt, pay.view(), sc.view()).ok());
  std::vector<uint8_t> want(pay.bytes.size(), 0);
  want[size_t((3 * kD + 5) * 384 + 16)] = 0x78;
  want[size_t((3 * kD + 5) * 384 + 128)] = 0xF8;
  want[size_t((15 * kD + 127) * 384 + 256)] = 0x78;
  EXPECT_EQ(diff_bytes(want, pay.bytes.data(), pay.bytes.size()), "");
  EXPECT_EQ(sc.bytes[size_t((0 * 16 + 3) * kD + 5)], 127 - 8);
  EXPECT_EQ(sc.bytes[size_t((4 * 16 + 3) * kD + 5)], 127 - 7);
  EXPECT_EQ(sc.bytes[size_t((8 * 16 + 15) * kD + 127)], 127 - 6);
}

// ---------------------------------------------------------------- exact values and special blocks

class QuantizeSpecial : public ::testing::TestWithParam<bool> {};  // bf16 input?

// One sequence of 40 tokens, H = 1: hand-built hdim blocks, checked by value and against the
// direct implementation; seq and square32 blocks holding NaN/inf checked the same way.
TEST_P(QuantizeSpecial, HdimBlocks) {
  Problem p = make_problem({40}, 1, GetParam());
  std::vector<float> v(size_t(p.T * kD), 1.f);
  auto blk = [&](int64_t t, int k) { return &v[size_t(xi(p, t, 0, 32 * k))]; };
  const float sub130 = float(std::ldexp(1.0, -130)), sub131 = float(std::ldexp(1.0, -131)),
              sub133 = float(std::ldexp(1.0, -133));
  std::fill(blk(0, 0), blk(0, 0) + 32, 0.f);             // all +0
  std::fill(blk(0, 1), blk(0, 1) + 32, -0.f);            // all -0
  blk(0, 2)[5] = kNaN;                                   // NaN among ones
  blk(0, 3)[0] = -kNaN;                                  // negative NaN
  blk(1, 0)[3] = kInf;                                   // inf among ones
  std::fill(blk(1, 1), blk(1, 1) + 32, 2.f);
  blk(1, 1)[9] = -kInf;
  std::fill(blk(1, 2), blk(1, 2) + 32, sub130);          // fp32 subnormal only
  std::fill(blk(1, 3), blk(1, 3) + 32, 0.f);             // subnormal and signed zeros
  blk(1, 3)[0] = -sub131;
  blk(1, 3)[1] = -0.f;
  blk(1, 3)[2] = sub133;
  std::fill(blk(2, 0), blk(2, 0) + 32, 0.f);             // block max 500
  blk(2, 0)[0] = 500.f;
  blk(2, 0)[1] = 250.f;
  blk(2, 0)[2] = -1.f;
  blk(2, 1)[0] = 240.f;                                  // block max 240, rest ones
  set_values(p, v);
  for (ScalingMode mode : {ScalingMode::kRceil, ScalingMode::kFloor}) {
    SCOPED_TRACE(to_string(mode));
    const Expected e = expect_hdim(p, mode);
    check_quantize(p, Orientation::kHdim, {mode, ScaleLayout::kPlain, PayloadLayout::kTokenMajor}, e);
    Buf pay({p.T, 1, kD}, DType::kE4M3, 0xA5);
    Buf sc({p.T, 1, 4}, DType::kE8M0, 0xA5);
    ASSERT_TRUE(quantize(p.x(), p.meta, Orientation::kHdim, {mode}, pay.view(), sc.view()).ok());
    auto S = [&](int64_t t, int k) { return int(sc.bytes[size_t(t * 4 + k)]); };
    auto Q = [&](int64_t t, int k, int i) { return int(pay.bytes[size_t(xi(p, t, 0, 32 * k + i))]); };
    const bool rceil = mode == ScalingMode::kRceil;
    // zero blocks: byte 0, payload +0 / -0
    EXPECT_EQ(S(0, 0), 0);
    EXPECT_EQ(S(0, 1), 0);
    for (int i = 0; i < 32; ++i) EXPECT_EQ(Q(0, 0, i), 0x00);
    for (int i = 0; i < 32; ++i) EXPECT_EQ(Q(0, 1, i), 0x80);
    // NaN -> scale 0xFF, the NaN element encodes sign | 0x7F
    EXPECT_EQ(S(0, 2), 0xFF);
    EXPECT_EQ(Q(0, 2, 5), 0x7F);
    EXPECT_EQ(S(0, 3), 0xFF);
    EXPECT_EQ(Q(0, 3, 0), 0xFF);
    // inf -> scale 0xFF
    EXPECT_EQ(S(1, 0), 0xFF);
    EXPECT_EQ(S(1, 1), 0xFF);
    // subnormal-only: 2^-130 / 448 is a nonzero fp32 subnormal: RCEIL byte 1; FLOOR
    // floor(log2) - 8 = -138 clamps to byte 0. Both divide by 2^-126: 2^-4 -> 0x18.
    EXPECT_EQ(S(1, 2), rceil ? 1 : 0);
    EXPECT_EQ(Q(1, 2, 0), 0x18);
    EXPECT_EQ(S(1, 3), rceil ? 1 : 0);
    EXPECT_EQ(Q(1, 3, 0), 0x90);  // -2^-131 * 2^126 = -2^-5
    EXPECT_EQ(Q(1, 3, 1), 0x80);  // -0 stays -0
    EXPECT_EQ(Q(1, 3, 2), 0x04);  // 2^-133 * 2^126 = 2^-7 = 4 * 2^-9
    EXPECT_EQ(Q(1, 3, 3), 0x00);
    // block max 500: FLOOR scale 1 (127), 500 clips to 448, 250 -> 256; RCEIL scale 2 (128),
    // 500/2 = 250 -> 256, 250/2 = 125 -> 128, -1/2 -> -0.5.
    EXPECT_EQ(S(2, 0), rceil ? 128 : 127);
    EXPECT_EQ(Q(2, 0, 0), rceil ? 0x78 : 0x7E);
    EXPECT_EQ(Q(2, 0, 1), rceil ? 0x70 : 0x78);
    EXPECT_EQ(Q(2, 0, 2), rceil ? 0xB0 : 0xB8);
    EXPECT_EQ(Q(2, 0, 3), 0x00);
    // ordinary all-ones block: RCEIL 1/448 -> 2^-8 (byte 119), 1 -> 256; FLOOR 2^-8 too.
    EXPECT_EQ(S(3, 0), 119);
    EXPECT_EQ(Q(3, 0, 0), 0x78);
    // block max 240 (an e4m3 value): RCEIL 240/448 -> scale 1 (127), exact; FLOOR floor(log2 240)
    // = 7 -> scale 2^-1 (126), 240 / 2^-1 = 480 clips to 448 (decodes as 224).
    EXPECT_EQ(S(2, 1), rceil ? 127 : 126);
    EXPECT_EQ(Q(2, 1, 0), rceil ? 0x77 : 0x7E);
    EXPECT_EQ(Q(2, 1, 1), rceil ? 0x38 : 0x40);  // 1 -> 1 or 2
  }
}

TEST_P(QuantizeSpecial, SeqAndSquareBlocks) {
  Problem p = make_problem({33, 70}, 2, GetParam());
  std::vector<float> v(size_t(p.T * p.H * kD));
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(int(i % 13) - 6) * 0.375f;
  v[size_t(xi(p, 5, 1, 40))] = kNaN;     // seq 0 group 0, head 1, column 40
  v[size_t(xi(p, 32, 0, 3))] = -kInf;    // seq 0 tail group (1 token), head 0, column 3
  for (int64_t t = 33 + 64; t < 33 + 70; ++t)   // seq 1 tail group (6 tokens), head 0: zeros
    for (int d = 0; d < 32; ++d) v[size_t(xi(p, t, 0, d))] = (t % 2) ? -0.f : 0.f;
  set_values(p, v);
  for (ScalingMode mode : {ScalingMode::kRceil, ScalingMode::kFloor}) {
    SCOPED_TRACE(to_string(mode));
    const Expected es = expect_tok(p, mode, 1), eq = expect_tok(p, mode, 32);
    for (ScaleLayout sl : {ScaleLayout::kPlain, ScaleLayout::kBlocked128x4})
      for (PayloadLayout pl : {PayloadLayout::kTokenMajor, PayloadLayout::kTokenContiguous}) {
        check_quantize(p, Orientation::kSeq, {mode, sl, pl}, es);
        check_quantize(p, Orientation::kSquare32, {mode, sl, pl}, eq);
      }
    // By hand: plain seq (P/32 = 8, H = 2, 128); seq 1 starts at padded group 4.
    EXPECT_EQ(es.scales[size_t((0 * 2 + 1) * kD + 40)], 0xFF);
    EXPECT_NE(es.scales[size_t((0 * 2 + 1) * kD + 41)], 0xFF);
    EXPECT_EQ(es.scales[size_t((1 * 2 + 0) * kD + 3)], 0xFF);
    EXPECT_NE(es.scales[size_t((1 * 2 + 1) * kD + 3)], 0xFF);
    EXPECT_EQ(es.scales[size_t((6 * 2 + 0) * kD + 0)], 0);  // zero tail block of seq 1
    EXPECT_EQ(es.scales[size_t((7 * 2 + 0) * kD + 0)], 0);  // padding group
    EXPECT_EQ(es.payload[size_t(xi(p, 5, 1, 40))], 0x7F);
    EXPECT_EQ(es.payload[size_t(xi(p, 99, 0, 0))], 0x80);  // -0 stays -0
    EXPECT_EQ(es.payload[size_t(xi(p, 98, 0, 0))], 0x00);
    // square32 plain (8, 2, 4)
    EXPECT_EQ(eq.scales[size_t((0 * 2 + 1) * 4 + 1)], 0xFF);
    EXPECT_EQ(eq.scales[size_t((1 * 2 + 0) * 4 + 0)], 0xFF);
    EXPECT_EQ(eq.scales[size_t((6 * 2 + 0) * 4 + 0)], 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Input, QuantizeSpecial, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "bf16" : "fp32"; });

// ---------------------------------------------------------------- converters

// Payload and scale converters: their outputs equal quantize's direct output in the other layout,
// round trips are exact, and on arbitrary bytes they follow the §3 formulas (padding zero).
TEST(QuantizeConverters, EqualDirectOutputsAndRoundTrip) {
  Problem p = make_problem({33, 0, 129, 1, 128}, 3, false);
  set_values(p, random_values(p, 5));
  for (Orientation o : {Orientation::kHdim, Orientation::kSeq, Orientation::kSquare32}) {
    SCOPED_TRACE(to_string(o));
    const Expected e = expect(p, o, ScalingMode::kRceil);
    const auto wtc = token_contiguous(p, e.payload);
    const auto wbl = blocked_from_plain(p, o, e.scales);
    // quantize's direct outputs in both layouts
    Buf tm(payload_dims(p, PayloadLayout::kTokenMajor), DType::kE4M3, 0xA5);
    Buf plain(scale_dims(p, o, ScaleLayout::kPlain), DType::kE8M0, 0xA5);
    Buf blocked(scale_dims(p, o, ScaleLayout::kBlocked128x4), DType::kE8M0, 0xA5);
    ASSERT_TRUE(quantize(p.x(), p.meta, o, {}, tm.view(), plain.view()).ok());
    ASSERT_TRUE(quantize(p.x(), p.meta, o, {ScalingMode::kRceil, ScaleLayout::kBlocked128x4}, tm.view(), blocked.view()).ok());
    EXPECT_EQ(diff_bytes(wbl, blocked.bytes.data(), blocked.bytes.size()), "");
    for (uint8_t poison : kPoisons) {
      Buf b2(scale_dims(p, o, ScaleLayout::kBlocked128x4), DType::kE8M0, poison);
      ASSERT_TRUE(scales_to_blocked(plain.view(), p.meta, p.H, o, b2.view()).ok());
      EXPECT_EQ(diff_bytes(blocked.bytes, b2.bytes.data(), b2.bytes.size()), "") << "scales_to_blocked";
      Buf p2(scale_dims(p, o, ScaleLayout::kPlain), DType::kE8M0, poison);
      ASSERT_TRUE(scales_to_plain(blocked.view(), p.meta, p.H, o, p2.view()).ok());
      EXPECT_EQ(diff_bytes(plain.bytes, p2.bytes.data(), p2.bytes.size()), "") << "scales_to_plain";
    }
    if (o == Orientation::kHdim) continue;
    Buf tc(payload_dims(p, PayloadLayout::kTokenContiguous), DType::kE4M3, 0xA5);
    ASSERT_TRUE(quantize(p.x(), p.meta, o, {ScalingMode::kRceil, ScaleLayout::kPlain, PayloadLayout::kTokenContiguous},
                         tc.view(), plain.view()).ok());
    EXPECT_EQ(diff_bytes(wtc, tc.bytes.data(), tc.bytes.size()), "");
    for (uint8_t poison : kPoisons) {
      Buf tc2(payload_dims(p, PayloadLayout::kTokenContiguous), DType::kE4M3, poison);
      ASSERT_TRUE(to_token_contiguous(tm.view(), p.meta, tc2.view()).ok());
      EXPECT_EQ(diff_bytes(tc.bytes, tc2.bytes.data(), tc2.bytes.size()), "") << "to_token_contiguous";
      Buf tm2(payload_dims(p, PayloadLayout::kTokenMajor), DType::kE4M3, poison);
      ASSERT_TRUE(to_token_major(tc.view(), p.meta, tm2.view()).ok());
      EXPECT_EQ(diff_bytes(tm.bytes, tm2.bytes.data(), tm2.bytes.size()), "") << "to_token_major";
    }
  }
}

TEST(QuantizeConverters, ArbitraryBytesFollowFormulas) {
  Problem p = make_problem({1, 127, 0, 32, 200}, 2, false);
  std::mt19937_64 rng(9);
  auto random_bytes = [&](int64_t n) {
    std::vector<uint8_t> v(static_cast<size_t>(n));
    for (auto& b : v) b = uint8_t(rng());
    return v;
  };
  // payload, any byte dtype
  Buf tm(payload_dims(p, PayloadLayout::kTokenMajor), DType::kUInt8, 0);
  tm.bytes = random_bytes(prod(tm.dims));
  Buf tc(payload_dims(p, PayloadLayout::kTokenContiguous), DType::kUInt8, 0xA5);
  ASSERT_TRUE(to_token_contiguous(tm.view(), p.meta, tc.view()).ok());
  EXPECT_EQ(diff_bytes(token_contiguous(p, tm.bytes), tc.bytes.data(), tc.bytes.size()), "");
  Buf tm2(payload_dims(p, PayloadLayout::kTokenMajor), DType::kE8M0, 0xA5);
  ASSERT_TRUE(to_token_major(tc.view(), p.meta, tm2.view()).ok());
  EXPECT_EQ(tm2.bytes, tm.bytes);
  // a token-contiguous source with garbage in its padding: padding is not read back
  Buf tcg(payload_dims(p, PayloadLayout::kTokenContiguous), DType::kE4M3, 0);
  tcg.bytes = random_bytes(prod(tcg.dims));
  Buf tm3(payload_dims(p, PayloadLayout::kTokenMajor), DType::kE4M3, 0xA5);
  ASSERT_TRUE(to_token_major(tcg.view(), p.meta, tm3.view()).ok());
  for (size_t b = 0; b < p.lengths.size(); ++b)
    for (int64_t i = 0; i < p.lengths[b]; ++i)
      for (int64_t h = 0; h < p.H; ++h)
        for (int d = 0; d < kD; ++d)
          ASSERT_EQ(tm3.bytes[size_t(xi(p, p.cu[b] + i, h, d))], tcg.bytes[size_t((h * kD + d) * p.P + p.sf[b] + i)]);
  // scales
  for (Orientation o : {Orientation::kHdim, Orientation::kSeq, Orientation::kSquare32}) {
    SCOPED_TRACE(to_string(o));
    Buf plain(scale_dims(p, o, ScaleLayout::kPlain), DType::kE8M0, 0);
    plain.bytes = random_bytes(prod(plain.dims));
    Buf blocked(scale_dims(p, o, ScaleLayout::kBlocked128x4), DType::kE8M0, 0xA5);
    ASSERT_TRUE(scales_to_blocked(plain.view(), p.meta, p.H, o, blocked.view()).ok());
    EXPECT_EQ(diff_bytes(blocked_from_plain(p, o, plain.bytes), blocked.bytes.data(), blocked.bytes.size()), "");
    Buf rb(scale_dims(p, o, ScaleLayout::kBlocked128x4), DType::kUInt8, 0);
    rb.bytes = random_bytes(prod(rb.dims));
    Buf pl(scale_dims(p, o, ScaleLayout::kPlain), DType::kUInt8, 0xA5);
    ASSERT_TRUE(scales_to_plain(rb.view(), p.meta, p.H, o, pl.view()).ok());
    EXPECT_EQ(diff_bytes(plain_from_blocked(p, o, rb.bytes), pl.bytes.data(), pl.bytes.size()), "");
  }
}

// ---------------------------------------------------------------- dequantize

// out = e4m3(payload) * 2^(scale - 127) of the element's block, for arbitrary payload and scale
// bytes (NaN codes, 0x00 and 0xFE scales included), each orientation and layout, fp32 and bf16 out.
TEST(Dequantize, EqualsDecodeTimesScale) {
  Problem p = make_problem({129, 0, 31, 64}, 2, false);
  std::mt19937_64 rng(21);
  for (Orientation o : {Orientation::kHdim, Orientation::kSeq, Orientation::kSquare32})
    for (ScaleLayout sl : {ScaleLayout::kPlain, ScaleLayout::kBlocked128x4})
      for (PayloadLayout pl : {PayloadLayout::kTokenMajor, PayloadLayout::kTokenContiguous}) {
        if (o == Orientation::kHdim && pl != PayloadLayout::kTokenMajor) continue;
        SCOPED_TRACE(name_of(o, {ScalingMode::kRceil, sl, pl}));
        Buf pay(payload_dims(p, pl), DType::kE4M3, 0);
        for (auto& b : pay.bytes) b = uint8_t(rng());
        Buf sc(scale_dims(p, o, sl), DType::kE8M0, 0);
        for (auto& b : sc.bytes) b = uint8_t(rng());
        // the scale of each element, looked up by the formulas written here
        const std::vector<uint8_t> plain = sl == ScaleLayout::kPlain ? sc.bytes : plain_from_blocked(p, o, sc.bytes);
        for (bool bf16 : {false, true}) {
          std::vector<float> of(size_t(p.T * p.H * kD), kNaN);
          std::vector<uint16_t> ob(size_t(p.T * p.H * kD), 0xA5A5);
          const TensorView out = bf16 ? make_view(ob.data(), DType::kBFloat16, Device::kCPU, {p.T, p.H, kD})
                                      : make_view(of.data(), DType::kFloat32, Device::kCPU, {p.T, p.H, kD});
          const Status st = dequantize(pay.view(), sc.view(), p.meta, o, sl, pl, out);
          ASSERT_TRUE(st.ok()) << st.message();
          int bad = 0;
          for (size_t b = 0; b < p.lengths.size(); ++b)
            for (int64_t i = 0; i < p.lengths[b]; ++i)
              for (int64_t h = 0; h < p.H; ++h)
                for (int d = 0; d < kD; ++d) {
                  const int64_t t = p.cu[b] + i, tp = p.sf[b] + i, g = tp / 32;
                  const uint8_t q = pay.bytes[size_t(pl == PayloadLayout::kTokenMajor ? xi(p, t, h, d)
                                                                                      : (h * kD + d) * p.P + tp)];
                  // square32 blocked: each token reads its own row (rows of a block agree when
                  // quantize wrote them; here they are arbitrary).
                  const uint8_t s =
                      o == Orientation::kHdim  ? plain[size_t((t * p.H + h) * 4 + d / 32)]
                      : o == Orientation::kSeq ? plain[size_t((g * p.H + h) * kD + d)]
                      : sl == ScaleLayout::kPlain
                          ? plain[size_t((g * p.H + h) * 4 + d / 32)]
                          : sc.bytes[size_t(mxtest::ref_hdim_blocked(h, tp, d / 32, p.P))];
                  const double want = mxtest::e4m3_value(q) * mxtest::e8m0_value(s);
                  // NaN outputs have one defined pattern (the reference's rule, shared with CUDA):
                  // a NaN element gives its signed quiet NaN, else a NaN scale gives +qNaN.
                  const uint32_t want_nan = (q & 0x7F) == 0x7F ? (uint32_t(q & 0x80) << 24) | 0x7FC00000u : 0x7FC00000u;
                  const int64_t k = xi(p, t, h, d);
                  bool ok;
                  if (bf16) {
                    ok = ob[size_t(k)] == (std::isnan(want) ? uint16_t(want_nan >> 16) : mxtest::bf16_of_exact(want));
                  } else {
                    const uint32_t got = mxtest::bits_of(of[size_t(k)]);
                    ok = got == (std::isnan(want) ? want_nan : mxtest::bits_of(mxtest::float_of_exact(want)));
                  }
                  if (!ok && bad++ < 5)
                    ADD_FAILURE() << (bf16 ? "bf16" : "fp32") << " t=" << t << " h=" << h << " d=" << d
                                  << " q=" << int(q) << " s=" << int(s) << " want " << want;
                }
          EXPECT_EQ(bad, 0);
        }
      }
}

// Dequantizing quantize's output recovers the input where it is exactly representable.
TEST(Dequantize, RoundTripsRepresentableValues) {
  Problem p = make_problem({45, 130}, 1, true);
  std::vector<float> v(size_t(p.T * kD));
  std::mt19937_64 rng(4);
  for (auto& x : v) x = mxtest::float_of(mxtest::bits_of(float(mxtest::e4m3_value(uint8_t(rng() % 0x7F)))) ^ ((rng() & 1) << 31));
  set_values(p, v);
  for (Orientation o : {Orientation::kHdim, Orientation::kSeq, Orientation::kSquare32}) {
    Buf pay(payload_dims(p, PayloadLayout::kTokenMajor), DType::kE4M3, 0xA5);
    Buf sc(scale_dims(p, o, ScaleLayout::kBlocked128x4), DType::kE8M0, 0xA5);
    QuantizeOptions opt{ScalingMode::kRceil, ScaleLayout::kBlocked128x4, PayloadLayout::kTokenMajor};
    ASSERT_TRUE(quantize(p.x(), p.meta, o, opt, pay.view(), sc.view()).ok());
    std::vector<float> out(v.size(), kNaN);
    ASSERT_TRUE(dequantize(pay.view(), sc.view(), p.meta, o, ScaleLayout::kBlocked128x4, PayloadLayout::kTokenMajor,
                           make_view(out.data(), DType::kFloat32, Device::kCPU, {p.T, 1, kD})).ok());
    // RCEIL scales of e4m3-valued blocks are <= 1 and never clip, so every |x| >= 1 stays a
    // normal e4m3 with its 4 significant bits after division: exact round trip. (FLOOR would clip
    // a block max with mantissa 1.875, e.g. 240 -> 480 > 448: see QuantizeSpecial.)
    for (int64_t t = 0; t < p.T; ++t)
      for (int d = 0; d < kD; ++d) {
        const float x = p.vals[size_t(xi(p, t, 0, d))], y = out[size_t(xi(p, t, 0, d))];
        if (std::fabs(x) >= 1.f) {
          EXPECT_EQ(x, y) << to_string(o) << " t=" << t << " d=" << d;
        }
      }
  }
}

// ---------------------------------------------------------------- empty batches

TEST(QuantizeEmpty, ZeroTokenBatchesSucceedAndWriteNothing) {
  JaggedMeta meta;
  ASSERT_TRUE(JaggedMeta::FromLengths({0, 0}, &meta).ok());
  const TensorView x = make_view(nullptr, DType::kFloat32, Device::kCPU, {0, 4, kD});
  for (Orientation o : {Orientation::kHdim, Orientation::kSeq, Orientation::kSquare32})
    for (ScaleLayout sl : {ScaleLayout::kPlain, ScaleLayout::kBlocked128x4}) {
      Problem p = make_problem({0, 0}, 4, false);
      const auto sd = scale_dims(p, o, sl);
      const auto pd = payload_dims(p, PayloadLayout::kTokenMajor);
      const Status st = quantize(x, meta, o, {ScalingMode::kRceil, sl},
                                 make_view(nullptr, DType::kE4M3, Device::kCPU, int(pd.size()), pd.data()),
                                 make_view(nullptr, DType::kE8M0, Device::kCPU, int(sd.size()), sd.data()));
      EXPECT_TRUE(st.ok()) << st.message();
    }
}

}  // namespace
}  // namespace mxflash
