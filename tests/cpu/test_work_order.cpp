// The causal kernels' work orders (src/common/work_order.h): every item exactly once, the windows
// kept in the list's order, heavy items first within a window, and the static order's CTAs loaded
// within one item of each other where the plain order was not.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "common/work_order.h"

namespace mxflash::attn {
namespace {

// The causal dK/dV weights of B sequences of n tiles and H heads, each head's tiles in a row (a K
// tile t faces n - t Q tiles), plus one for the item itself.
std::vector<int64_t> causal_weights(int B, int H, int n) {
  std::vector<int64_t> w;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < n; ++t) w.push_back(n - t + 1);
  return w;
}

// Each CTA's work under a static order (slot c + j ctas is CTA c's j-th item).
std::vector<int64_t> loads(const std::vector<int>& order, const std::vector<int64_t>& w, int ctas) {
  std::vector<int64_t> l(size_t(ctas), 0);
  for (size_t s = 0; s < order.size(); ++s)
    if (order[s] >= 0) l[s % size_t(ctas)] += w[size_t(order[s])];
  return l;
}

void expect_permutation(std::vector<int> order, size_t n) {
  order.erase(std::remove(order.begin(), order.end(), -1), order.end());
  ASSERT_EQ(order.size(), n);
  std::sort(order.begin(), order.end());
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(order[i], int(i));
}

TEST(WorkOrder, StaticOrderBalancesTheCausalLists) {
  for (const auto& [B, n] : {std::pair{2, 64}, std::pair{8, 16}, std::pair{1, 3}}) {
    const int H = 16, ctas = 132;
    const std::vector<int64_t> w = causal_weights(B, H, n);
    const int c = std::min<int>(ctas, int(w.size()));
    const std::vector<int> plain = static_order(w, c, 0);
    const std::vector<int> lpt = static_order(w, c, 4 * c);
    expect_permutation(lpt, w.size());
    EXPECT_EQ(plain.size(), w.size());
    for (size_t i = 0; i < plain.size(); ++i) ASSERT_EQ(plain[i], int(i));
    const int64_t total = std::accumulate(w.begin(), w.end(), int64_t(0));
    const int64_t wmax = *std::max_element(w.begin(), w.end());
    const std::vector<int64_t> lp = loads(plain, w, c), ll = loads(lpt, w, c);
    const int64_t max_plain = *std::max_element(lp.begin(), lp.end());
    const int64_t max_lpt = *std::max_element(ll.begin(), ll.end());
    // LPT's bound: no CTA above the mean by more than one item
    EXPECT_LE(max_lpt, (total + c - 1) / c + wmax) << B << " x " << n;
    if (n >= 16) {
      EXPECT_LT(max_lpt, max_plain) << B << " x " << n;
      EXPECT_LE(double(max_lpt), 1.03 * double(total) / c) << B << " x " << n;
    }
    // each CTA walks its items heaviest first within a window
    for (int cta = 0; cta < c; ++cta) {
      int64_t prev = INT64_MAX;
      for (size_t s = size_t(cta); s < lpt.size(); s += size_t(c)) {
        if (lpt[s] < 0) continue;
        if (lpt[s] / (4 * c) != 0) break;  // (the first window only)
        EXPECT_LE(w[size_t(lpt[s])], prev);
        prev = w[size_t(lpt[s])];
      }
    }
  }
}

TEST(WorkOrder, StaticOrderKeepsWindowsInListOrder) {
  std::mt19937 rng(3);
  std::vector<int64_t> w(1000);
  for (auto& x : w) x = 1 + int64_t(rng() % 50);
  const int ctas = 7;
  const int64_t window = 100;
  const std::vector<int> order = static_order(w, ctas, window);
  expect_permutation(order, w.size());
  // A CTA's items come window by window: its j-th item never lies in an earlier window than its
  // (j-1)-th.
  for (int c = 0; c < ctas; ++c) {
    int last_window = -1;
    for (size_t s = size_t(c); s < order.size(); s += ctas) {
      if (order[s] < 0) continue;
      const int win = int(order[s] / window);
      EXPECT_GE(win, last_window);
      last_window = win;
    }
  }
  // Padding only at the end of a CTA's slots.
  for (int c = 0; c < ctas; ++c) {
    bool ended = false;
    for (size_t s = size_t(c); s < order.size(); s += ctas) {
      if (order[s] < 0) ended = true;
      else EXPECT_FALSE(ended) << "an item after an empty slot of CTA " << c;
    }
  }
}

TEST(WorkOrder, DynamicOrderSortsEachWindow) {
  const std::vector<int64_t> w = causal_weights(2, 3, 10);
  EXPECT_EQ(dynamic_order(w, 0), [&] {
    std::vector<int> id(w.size());
    std::iota(id.begin(), id.end(), 0);
    return id;
  }());
  const int64_t window = 7;
  const std::vector<int> order = dynamic_order(w, window);
  expect_permutation(order, w.size());
  for (size_t s = 0; s < order.size(); ++s) {
    EXPECT_EQ(order[s] / window, int64_t(s) / window) << "slot " << s << " left its window";
    if (s % size_t(window) != 0) {
      EXPECT_LE(w[size_t(order[s])], w[size_t(order[s - 1])]);
      if (w[size_t(order[s])] == w[size_t(order[s - 1])]) EXPECT_GT(order[s], order[s - 1]) << "stable";
    }
  }
}

TEST(WorkOrder, EmptyAndTinyLists) {
  EXPECT_TRUE(static_order({}, 4, 16).empty());
  EXPECT_TRUE(dynamic_order({}, 16).empty());
  const std::vector<int> one = static_order({5}, 1, 16);
  EXPECT_EQ(one, std::vector<int>{0});
  const std::vector<int> two = static_order({1, 9}, 2, 16);
  EXPECT_EQ(two, (std::vector<int>{1, 0}));  // the heavy item to CTA 0, the light one to CTA 1
}

}  // namespace
}  // namespace mxflash::attn
