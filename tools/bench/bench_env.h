// The machine a run was measured on: CUDA device properties, versions, and current clocks read
// through NVML when libnvidia-ml can be loaded (optional, dlopen'ed).
#pragma once
#include "bench_report.h"

namespace mxflash::bench {

EnvInfo collect_env(int device);
// Current SM / memory clock in MHz through NVML, or -1 when NVML is not available.
int nvml_sm_clock_mhz();
int nvml_mem_clock_mhz();

}  // namespace mxflash::bench
