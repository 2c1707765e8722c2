#include "bench_env.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <ctime>

#include "bench_impl.h"
#include "nvml.h"

namespace mxflash::bench {

int nvml_sm_clock_mhz() { return tools::nvml_clock_mhz(tools::kNvmlClockSm, false); }
int nvml_mem_clock_mhz() { return tools::nvml_clock_mhz(tools::kNvmlClockMem, false); }

EnvInfo collect_env(int device) {
  EnvInfo e;
  e.device = device;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
    e.gpu_name = prop.name;
    e.sm_count = prop.multiProcessorCount;
    e.cc_major = prop.major;
    e.cc_minor = prop.minor;
    e.l2_bytes = prop.l2CacheSize;
    e.memory_bytes = int64_t(prop.totalGlobalMem);
    e.mem_bus_width_bits = prop.memoryBusWidth;
  }
  cudaDeviceGetAttribute(&e.max_sm_clock_khz, cudaDevAttrClockRate, device);
  cudaDeviceGetAttribute(&e.max_mem_clock_khz, cudaDevAttrMemoryClockRate, device);
  cudaDriverGetVersion(&e.driver_version);
  cudaRuntimeGetVersion(&e.runtime_version);
  char bus[64] = {0};
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, device) == cudaSuccess) {
    e.pci_bus_id = bus;
    tools::nvml_bind(bus);
  }
  e.nvml_sm_clock_mhz = nvml_sm_clock_mhz();
  e.nvml_mem_clock_mhz = nvml_mem_clock_mhz();
  e.nvml_max_sm_clock_mhz = tools::nvml_clock_mhz(tools::kNvmlClockSm, true);
  e.cudnn_runtime_version = cudnn_runtime_version();
  e.cudnn_compiled_version = cudnn_compiled_version();
  e.cudnn_frontend_version = cudnn_frontend_version();
  char host[256] = {0};
  if (gethostname(host, sizeof host - 1) == 0) e.hostname = host;
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char ts[32];
  std::strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", &tm);
  e.timestamp = ts;
  return e;
}

}  // namespace mxflash::bench
