// Clock traces of the attention kernels' consumer warpgroups (experiments builds only,
// -DMXFLASH_FWD_EXPERIMENTS=1): lane 0 of a warpgroup's first warp in up to four chosen CTAs writes
// the SM clock at fixed points of its main loop into a per-file device table, and the host writes
// the table as text (one line of kTraceEvents clocks per CTA x warpgroup x slot) to the file named
// by an environment variable after a chosen launch. scripts/attn_trace.py prints it by phase.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "mxflash/status.h"

namespace mxflash::cuda::attn {

inline constexpr int kTraceCtas = 4, kTraceGroups = 3, kTraceSlots = 128, kTraceEvents = 8;

#if MXFLASH_FWD_EXPERIMENTS
// One table per translation unit (no relocatable device code): each kernel file dumps its own.
static __device__ uint32_t g_trace[kTraceCtas][kTraceGroups][kTraceSlots][kTraceEvents];
#endif

// The table row of CTA `cta`, or -1 when it is not traced.
__device__ __forceinline__ int trace_cta_slot(unsigned cta, unsigned c0, unsigned c1, unsigned c2, unsigned c3) {
  return cta == c0 ? 0 : cta == c1 ? 1 : cta == c2 ? 2 : cta == c3 ? 3 : -1;
}

// The SM clock into the table (row >= 0: a traced CTA's lane 0 of its warpgroup's first warp).
__device__ __forceinline__ void trace_stamp(int row, int group, int slot, int event) {
#if MXFLASH_FWD_EXPERIMENTS
  if (row >= 0 && slot < kTraceSlots) {
    uint32_t t;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(t)::"memory");
    g_trace[row][group][slot][event] = t;
  }
#else
  (void)row, (void)group, (void)slot, (void)event;
#endif
}

#if MXFLASH_FWD_EXPERIMENTS
// After the `due`-th call (per call site), the table to the file named by $env, if set. Static, as
// the table: an inline function would be merged across the files that include this one, and read
// one file's table for all.
static Status dump_trace_when_due(int& calls, int due, const char* env, cudaStream_t stream) {
  const char* path = std::getenv(env);
  if (++calls != due || !path) return Status::Ok();
  std::vector<uint32_t> t(sizeof(g_trace) / sizeof(uint32_t));
  if (cudaStreamSynchronize(stream) != cudaSuccess || cudaMemcpyFromSymbol(t.data(), g_trace, t.size() * 4) != cudaSuccess)
    return Status::Cuda("trace: copying the clock table failed");
  FILE* f = std::fopen(path, "w");
  if (!f) return Status::Invalid(std::string(env) + ": cannot write " + path);
  for (size_t i = 0; i < t.size(); i += kTraceEvents) {
    for (int e = 0; e < kTraceEvents; ++e) std::fprintf(f, e ? " %u" : "%u", t[i + size_t(e)]);
    std::fprintf(f, "\n");
  }
  std::fclose(f);
  return Status::Ok();
}
#endif

}  // namespace mxflash::cuda::attn
