// The work lists of the sm_90a attention kernels (forward: FwdParams::tiles; backward:
// BwdParams::items): built on the host, decoded per CTA / persistent-loop step on the device.
//
// A list holds one entry per tile (Q tiles for the forward and the dQ kernel, K/V tiles for the
// dK/dV kernel), the sequences with the most work per tile first (a jagged batch then runs its long
// sequences first and fills the tail with short ones), each entry (sequence b, list position of b's
// first tile). The kernels' work items are the list's entries x heads: item `index` belongs to the
// sequence of entry index / heads, and within that sequence's tiles x heads it is either the heads
// in turn per tile or each head's tiles in a row (heads_in_turn).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/work_order.h"
#include "cuda/common/upload.h"

namespace mxflash::cuda::attn {

// tiles_of[b] tiles of each sequence b, the sequences in decreasing work_of[b] (stable).
inline std::vector<int2> work_list(const std::vector<int>& tiles_of, const std::vector<int>& work_of) {
  std::vector<int> order(tiles_of.size());
  for (size_t b = 0; b < order.size(); ++b) order[b] = int(b);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return work_of[size_t(x)] > work_of[size_t(y)]; });
  std::vector<int2> list;
  for (const int b : order) {
    const int first = int(list.size());
    for (int t = 0; t < tiles_of[size_t(b)]; ++t) list.push_back(make_int2(b, first));
  }
  return list;
}

// A work list in device memory is followed by `counters` zeroed counters (at least one int2 slot):
// the persistent kernels' item counter first, then any the launch needs (the forward's split items'
// arrivals). Bytes of a list of n entries with them.
inline size_t work_list_bytes(size_t n, size_t counters = 1) {
  return (n + std::max<size_t>(1, (counters + 1) / 2)) * sizeof(int2);
}

// Uploads `list` to `dst` (work_list_bytes(list.size(), counters) bytes) with the counters zeroed,
// in the same upload: every launch on `stream` after it starts from 0 with no memset of its own.
// Returns the first counter (the persistent kernels' `next_item`); the others follow it.
inline Status upload_work_list(uint8_t* dst, const std::vector<int2>& list, cudaStream_t stream, unsigned** counter,
                               size_t counters = 1) {
  std::vector<int2> upload(list);
  upload.resize(work_list_bytes(list.size(), counters) / sizeof(int2), int2{0, 0});
  MXFLASH_RETURN_IF_ERROR(upload_to_device(dst, upload.data(), upload.size() * sizeof(int2), stream));
  *counter = reinterpret_cast<unsigned*>(dst + list.size() * sizeof(int2));
  return Status::Ok();
}

// The order within a sequence: its heads in turn per tile (true), or each head's tiles in a row.
// The CTAs running at once then read the other side's operands (K/V for the forward, Q-side for
// dK/dV, K/V for dQ) of all heads, or of one or two heads. Heads in turn while all heads' operands
// (heads x longest sequence's bytes per head) fit in a third of L2. Measured on an H200
// (docs/performance.md): tiles in a row ran llm-long 4% faster both ways (64 MB of Q-side operands
// over 16 heads in the backward, 32 MB of K/V in the forward; DRAM reads of the dK/dV kernel 1.29
// GB -> 0.21 GB), and cross and jagged 4-5% slower backward (under 1 MB). The environment variable
// MXFLASH_WORK_ORDER=heads|tiles forces one order (A/B runs; the GPU tests check that both give
// the same bytes).
inline bool heads_in_turn(int64_t heads, int64_t bytes_per_head) {
  if (const char* e = std::getenv("MXFLASH_WORK_ORDER")) {
    if (std::string(e) == "heads") return true;
    if (std::string(e) == "tiles") return false;
  }
  static const int l2 = [] {
    int dev = 0, bytes = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, dev) != cudaSuccess) {
      cudaGetLastError();  // only a sizing hint
      bytes = 50 << 20;
    }
    return bytes;
  }();
  return heads * bytes_per_head <= int64_t(l2) / 3;
}

// Work item `index`'s head and tile within its sequence: `first` is the list position of the
// sequence's first tile (the .y of entry index / heads), `tiles` the sequence's tile count (>= 1:
// the sequence has entries).
struct HeadTile {
  int h, tile;
};
__device__ __forceinline__ HeadTile head_and_tile(unsigned index, unsigned first, unsigned tiles, unsigned heads,
                                                  bool heads_inner) {
  const unsigned off = index - first * heads;  // within the sequence's tiles x heads
  return {int(heads_inner ? off % heads : off / tiles), int(heads_inner ? off / heads : off % tiles)};
}

}  // namespace mxflash::cuda::attn
