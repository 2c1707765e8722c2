// The timing protocol of REFERENCE.md §6: warm-up by time, then a window of CUDA-event samples,
// each sample = `launches` back-to-back launches, inputs rotated for a cold L2.
#pragma once
#include <cuda_runtime.h>

#include <functional>
#include <string>

#include "bench_report.h"
#include "mxflash/status.h"

namespace mxflash::bench {

struct Protocol {
  double warmup_s = 1.0;
  double window_s = 5.0;
  int launches = 5;
};

// Enqueues one launch on input set `set`.
using LaunchFn = std::function<Status(int set)>;

// Number of input sets so that their total exceeds 2x L2: ceil(2*L2 / set_bytes), and at least 2
// unless one set alone exceeds 4x L2 (then consecutive launches cannot find each other's data).
int input_sets_for(int64_t set_bytes, int64_t l2_bytes);

// Warms up for p.warmup_s, then samples for p.window_s (at least 3 samples). Each chunk of samples
// starts behind one unmeasured launch so the first event is not recorded on an idle stream (which
// would add host enqueue latency). Fills samples_ms (per launch), stats, warm-up counts.
Status measure(const LaunchFn& launch, int n_sets, const Protocol& p, cudaStream_t stream, const std::string& label,
               ImplResult* out);

}  // namespace mxflash::bench
