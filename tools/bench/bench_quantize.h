// The quantize workload: ours (the MX quantizer through include/mxflash/quantize.h) on a ~1 GiB
// BF16 jagged batch, every orientation, next to a device-to-device copy of the same input measured
// in the same run.
#pragma once
#include <cuda_runtime.h>

#include "bench_harness.h"
#include "bench_options.h"
#include "bench_report.h"

namespace mxflash::bench {

// Fills `out` (shape, lengths, one result per orientation and one for the copy). Failures of one
// orientation are recorded in its result; the returned Status is for setup failures only.
Status run_quantize_case(const Options& opt, const Protocol& proto, int64_t l2_bytes, cudaStream_t stream,
                         CaseReport* out);

}  // namespace mxflash::bench
