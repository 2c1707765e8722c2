// Orders of a persistent kernel's work items of unequal weight (host only; work_list.cuh's kernels
// read them). tests/cpu/test_work_order.cpp.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace mxflash::attn {

// The causal mask's work orders (src/cuda/attention/attention_bwd_sm90.cu, causal_orders): its items
// weigh unequally (the tiles each faces), so a list's plain order leaves some CTAs of a persistent kernel with far more work than
// others (its static stride: up to 8% on llm-long, 18% on llm above the mean, by the items' tile
// counts). Both orders keep the list's order across windows of `window` items (the CTAs at work then
// read the operands of a few heads, as the list's order wants) and put each window's heavy items
// first. weight[i]: the work of item i (> 0). window <= 0: the list's order as it is.
//
// For a kernel whose CTAs take the next slot when free (an item counter): slot -> item, each window's
// items heaviest first.
inline std::vector<int> dynamic_order(const std::vector<int64_t>& weight, int64_t window) {
  const int64_t n = int64_t(weight.size());
  std::vector<int> order;
  for (int64_t i = 0; i < n; ++i) order.push_back(int(i));
  if (window <= 0) return order;
  for (int64_t w0 = 0; w0 < n; w0 += window)
    std::stable_sort(order.begin() + w0, order.begin() + std::min(n, w0 + window),
                     [&](int a, int b) { return weight[size_t(a)] > weight[size_t(b)]; });
  return order;
}

// For a kernel whose CTA c takes slots c, c + ctas, c + 2 ctas, ...: slot -> item (-1: none), each
// window's items, heaviest first, given to the CTA with the least work so far (ties: the lower CTA).
inline std::vector<int> static_order(const std::vector<int64_t>& weight, int ctas, int64_t window) {
  if (window <= 0 || ctas <= 0 || ctas >= (1 << 20)) return dynamic_order(weight, 0);  // (the list's order)
  const int64_t n = int64_t(weight.size());
  // A min-heap of (work so far) << 20 | CTA: one integer compare a step (the calls plan thousands
  // of items on the host, attention_bwd_sm90.cu), ties to the lower CTA.
  constexpr int kCtaBits = 20;
  std::vector<uint64_t> heap(static_cast<size_t>(ctas));
  for (int c = 0; c < ctas; ++c) heap[size_t(c)] = uint64_t(c);
  std::vector<int> cta_of(static_cast<size_t>(n)), round_of(static_cast<size_t>(n)), taken(static_cast<size_t>(ctas), 0);
  int rounds = 0;
  for (const int i : dynamic_order(weight, window)) {  // (each window's items, heaviest first)
    std::pop_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
    const int c = int(heap.back() & ((uint64_t(1) << kCtaBits) - 1));
    heap.back() += uint64_t(weight[size_t(i)]) << kCtaBits;
    std::push_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
    cta_of[size_t(i)] = c;
    round_of[size_t(i)] = taken[size_t(c)]++;
    rounds = std::max(rounds, taken[size_t(c)]);
  }
  std::vector<int> order(size_t(rounds) * size_t(ctas), -1);
  for (int64_t i = 0; i < n; ++i) order[size_t(cta_of[size_t(i)]) + size_t(round_of[size_t(i)]) * size_t(ctas)] = int(i);
  return order;
}

}  // namespace mxflash::attn
