// mxflash-bench numbers: FLOP counts (dense, broadcast Q, jagged, causal masks), the seeded jagged
// length generator, and the sample statistics.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "bench_options.h"
#include "bench_report.h"

namespace mxflash::bench {
namespace {

TEST(BenchFlops, DenseSelfAttention) {
  CaseLengths l{std::vector<int64_t>(8, 2048), std::vector<int64_t>(8, 2048)};
  // 4 * H * D * B * L^2 = 4 * 16 * 128 * 8 * 2048^2
  EXPECT_DOUBLE_EQ(attention_flops(l, 16, 128, false), 4.0 * 16 * 128 * 8 * 2048.0 * 2048.0);
  EXPECT_DOUBLE_EQ(attention_flops(l, 16, 128, true), 10.0 * 16 * 128 * 8 * 2048.0 * 2048.0);
  EXPECT_DOUBLE_EQ(attention_flops(l, 16, 128, false), 274877906944.0);
}

TEST(BenchFlops, BroadcastQCountsLqTimesSumLk) {
  CaseSpec c;
  ASSERT_TRUE([&] {
    std::vector<CaseSpec> v;
    const bool ok = preset_cases("cross", &v);
    c = v.at(0);
    return ok;
  }());
  CaseLengths l;
  std::string err;
  ASSERT_TRUE(realize_lengths(c, &l, &err)) << err;
  // Lq * sum(Lk) = 512 * 64 * 16384
  EXPECT_EQ(sum_lq_lk(l), int64_t(512) * 64 * 16384);
  EXPECT_DOUBLE_EQ(attention_flops(l, 3, 128, false), 4.0 * 3 * 128 * 512 * 64 * 16384.0);
}

TEST(BenchFlops, JaggedUsesRealLengths) {
  CaseLengths l{{512, 512, 512}, {17, 0, 129}};
  EXPECT_EQ(sum_lq_lk(l), 512 * (17 + 0 + 129));
  EXPECT_DOUBLE_EQ(attention_flops(l, 3, 128, true), 10.0 * 3 * 128 * 512 * 146);
  CaseLengths self{{17, 0, 129}, {17, 0, 129}};
  EXPECT_EQ(sum_lq_lk(self), 17 * 17 + 129 * 129);
}

// The unmasked (row, key) pairs counted one row at a time with the library's rule.
int64_t pairs_by_rows(const CaseLengths& l, CausalMask m) {
  int64_t s = 0;
  for (size_t b = 0; b < l.lq.size(); ++b)
    for (int64_t i = 0; i < l.lq[b]; ++i) s += causal_keys(m, i, l.lq[b], l.lk[b]);
  return s;
}

TEST(BenchFlops, CausalCountsTheUnmaskedPairs) {
  // Lq = Lk = L: L(L+1)/2 pairs either way
  CaseLengths sq{std::vector<int64_t>(8, 2048), std::vector<int64_t>(8, 2048)};
  for (CausalMask m : {CausalMask::kTopLeft, CausalMask::kBottomRight}) {
    EXPECT_EQ(attended_pairs(sq, m), int64_t(8) * 2048 * 2049 / 2);
    EXPECT_DOUBLE_EQ(attention_flops(sq, 16, 128, false, m), 4.0 * 16 * 128 * 8 * (2048.0 * 2049.0 / 2));
    EXPECT_DOUBLE_EQ(attention_flops(sq, 16, 128, true, m), 10.0 * 16 * 128 * 8 * (2048.0 * 2049.0 / 2));
  }
  EXPECT_EQ(attended_pairs(sq, CausalMask::kNone), sum_lq_lk(sq));
  EXPECT_DOUBLE_EQ(attention_flops(sq, 16, 128, false, CausalMask::kNone), attention_flops(sq, 16, 128, false));
  // Lq = 4, Lk = 2: top_left rows see 1, 2, 2, 2 keys; bottom_right 0, 0, 1, 2
  CaseLengths tall{{4}, {2}};
  EXPECT_EQ(attended_pairs(tall, CausalMask::kTopLeft), 7);
  EXPECT_EQ(attended_pairs(tall, CausalMask::kBottomRight), 3);
  // Lq = 2, Lk = 5: top_left 1, 2; bottom_right 4, 5
  CaseLengths wide{{2}, {5}};
  EXPECT_EQ(attended_pairs(wide, CausalMask::kTopLeft), 3);
  EXPECT_EQ(attended_pairs(wide, CausalMask::kBottomRight), 9);
  EXPECT_DOUBLE_EQ(attention_flops(wide, 3, 128, true, CausalMask::kBottomRight), 10.0 * 3 * 128 * 9);
}

TEST(BenchFlops, CausalClosedFormEqualsRowByRowCount) {
  CaseLengths l{{0, 1, 1, 5, 7, 40, 130, 512, 512, 512, 3}, {0, 0, 1, 9, 7, 33, 129, 17, 0, 16384, 1}};
  for (CausalMask m : {CausalMask::kNone, CausalMask::kTopLeft, CausalMask::kBottomRight})
    EXPECT_EQ(attended_pairs(l, m), pairs_by_rows(l, m)) << causal_name(m);
  // the presets, broadcast Q counted per K/V sequence
  std::vector<CaseSpec> cases;
  ASSERT_TRUE(preset_cases("all", &cases));
  for (const CaseSpec& c : cases) {
    CaseLengths r;
    std::string err;
    ASSERT_TRUE(realize_lengths(c, &r, &err)) << err;
    for (CausalMask m : {CausalMask::kTopLeft, CausalMask::kBottomRight}) {
      EXPECT_EQ(attended_pairs(r, m), pairs_by_rows(r, m)) << c.name << " " << causal_name(m);
      EXPECT_LT(attended_pairs(r, m), sum_lq_lk(r)) << c.name;
      EXPECT_DOUBLE_EQ(attention_flops(r, c.heads, 128, false, m), 4.0 * c.heads * 128 * double(pairs_by_rows(r, m)));
    }
  }
  // cross (Lq 512 broadcast, Lk 16384): top_left sees 512*513/2 pairs per sequence, bottom_right
  // 512*16384 - 511*512/2
  std::vector<CaseSpec> cross;
  ASSERT_TRUE(preset_cases("cross", &cross));
  CaseLengths cl;
  std::string err;
  ASSERT_TRUE(realize_lengths(cross[0], &cl, &err)) << err;
  EXPECT_EQ(attended_pairs(cl, CausalMask::kTopLeft), int64_t(64) * 512 * 513 / 2);
  EXPECT_EQ(attended_pairs(cl, CausalMask::kBottomRight), int64_t(64) * (512 * 16384 - 511 * 512 / 2));
}

TEST(BenchJagged, SeededDeterministicMeanAndBounds) {
  const auto a = jagged_lengths(768, 0.5, 16384, 1234);
  const auto b = jagged_lengths(768, 0.5, 16384, 1234);
  const auto c = jagged_lengths(768, 0.5, 16384, 1235);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  ASSERT_EQ(a.size(), 768u);
  for (uint64_t seed : {1ull, 7ull, 1234ull, 99999ull}) {
    for (double fill : {0.1, 0.25, 0.5, 0.75, 0.9, 1.0}) {
      for (int64_t max : {1, 7, 512, 16384}) {
        for (int64_t batch : {1, 5, 64, 768}) {
          const auto l = jagged_lengths(batch, fill, max, seed);
          ASSERT_EQ(int64_t(l.size()), batch);
          int64_t sum = 0;
          for (int64_t x : l) {
            EXPECT_GE(x, 0);
            EXPECT_LE(x, max);
            sum += x;
          }
          const double mean_fill = double(sum) / double(batch * max);
          // Exact up to rounding of the total and the min length of 1.
          const double tol = std::max(0.02 * fill, (1.0 + 0.5) / double(max));
          EXPECT_NEAR(mean_fill, fill, tol) << "seed " << seed << " fill " << fill << " max " << max << " batch "
                                            << batch;
        }
      }
    }
  }
}

TEST(BenchJagged, LengthsActuallyVary) {
  const auto l = jagged_lengths(768, 0.5, 16384, 1234);
  const auto [mn, mx] = std::minmax_element(l.begin(), l.end());
  EXPECT_LT(*mn, 2000);
  EXPECT_GT(*mx, 14000);
}

TEST(BenchJagged, KnownValuesAreStable) {
  // Pinned so that a change of generator (which would silently change the 'jagged' preset and
  // every number measured on it) fails here.
  EXPECT_EQ(jagged_lengths(4, 0.5, 100, 42), (std::vector<int64_t>{27, 42, 66, 65}));
  std::vector<CaseSpec> v;
  ASSERT_TRUE(preset_cases("jagged", &v));
  CaseLengths l;
  std::string err;
  ASSERT_TRUE(realize_lengths(v[0], &l, &err)) << err;
  EXPECT_EQ(l.lk[0], 15638);
  EXPECT_EQ(l.lk[1], 6354);
  EXPECT_EQ(l.lk[767], 8405);
  EXPECT_EQ(std::accumulate(l.lk.begin(), l.lk.end(), int64_t(0)), 768 * 8192);
}

TEST(BenchStats, KnownVectors) {
  Stats s = compute_stats({3.0, 1.0, 2.0});
  EXPECT_EQ(s.n, 3);
  EXPECT_DOUBLE_EQ(s.median, 2.0);
  EXPECT_DOUBLE_EQ(s.mean, 2.0);
  EXPECT_DOUBLE_EQ(s.min, 1.0);
  EXPECT_DOUBLE_EQ(s.max, 3.0);
  EXPECT_DOUBLE_EQ(s.stdev, 1.0);

  s = compute_stats({4.0, 1.0, 3.0, 2.0});
  EXPECT_DOUBLE_EQ(s.median, 2.5);
  EXPECT_DOUBLE_EQ(s.mean, 2.5);
  EXPECT_NEAR(s.stdev, std::sqrt(5.0 / 3.0), 1e-12);

  s = compute_stats({2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0});
  EXPECT_DOUBLE_EQ(s.mean, 5.0);
  EXPECT_DOUBLE_EQ(s.median, 4.5);
  EXPECT_NEAR(s.stdev, std::sqrt(32.0 / 7.0), 1e-12);

  s = compute_stats({1.5});
  EXPECT_DOUBLE_EQ(s.median, 1.5);
  EXPECT_DOUBLE_EQ(s.stdev, 0.0);
  s = compute_stats({});
  EXPECT_EQ(s.n, 0);
}

TEST(BenchStats, ThroughputUsesMedianAndUnits) {
  ImplResult r;
  r.samples_ms = {2.0, 1.0, 4.0};
  r.stats = compute_stats(r.samples_ms);
  r.work = 1e12;  // FLOP per launch
  r.unit = "TFLOP/s";
  EXPECT_DOUBLE_EQ(r.throughput(), 500.0);  // 1e12 / 2 ms
  EXPECT_DOUBLE_EQ(r.best_throughput(), 1000.0);
  r.unit = "GB/s";
  r.work = 4e9;  // bytes per launch
  EXPECT_DOUBLE_EQ(r.throughput(), 2000.0);
  r.status = "error";
  EXPECT_DOUBLE_EQ(r.throughput(), 0.0);
}

}  // namespace
}  // namespace mxflash::bench
