#include "bench_env.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <unistd.h>

#include <ctime>

#include "bench_impl.h"

namespace mxflash::bench {
namespace {

// The few NVML entry points used, resolved at run time so the binary needs no NVML at build time.
class Nvml {
 public:
  static Nvml& get() {
    static Nvml n;
    return n;
  }
  void bind(const char* pci_bus_id) {
    if (!init_ || dev_) return;
    if (by_pci_(pci_bus_id, &dev_) != 0) dev_ = nullptr;
  }
  int clock(int type, bool max) const {
    if (!dev_) return -1;
    unsigned v = 0;
    const int rc = max ? max_clock_(dev_, type, &v) : clock_(dev_, type, &v);
    return rc == 0 ? int(v) : -1;
  }
  bool energy_mj(unsigned long long* mj) const { return dev_ && energy_ && energy_(dev_, mj) == 0; }
  bool reasons(unsigned long long* r) const { return dev_ && reasons_ && reasons_(dev_, r) == 0; }

 private:
  using InitFn = int (*)();
  using ByPciFn = int (*)(const char*, void**);
  using ClockFn = int (*)(void*, int, unsigned*);
  using U64Fn = int (*)(void*, unsigned long long*);
  Nvml() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return;
    auto init = reinterpret_cast<InitFn>(dlsym(lib, "nvmlInit_v2"));
    by_pci_ = reinterpret_cast<ByPciFn>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    clock_ = reinterpret_cast<ClockFn>(dlsym(lib, "nvmlDeviceGetClockInfo"));
    max_clock_ = reinterpret_cast<ClockFn>(dlsym(lib, "nvmlDeviceGetMaxClockInfo"));
    // Optional: the energy counter (Volta and newer) and the clock-event (throttle) reasons, under
    // their newer name first.
    energy_ = reinterpret_cast<U64Fn>(dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption"));
    reasons_ = reinterpret_cast<U64Fn>(dlsym(lib, "nvmlDeviceGetCurrentClocksEventReasons"));
    if (!reasons_) reasons_ = reinterpret_cast<U64Fn>(dlsym(lib, "nvmlDeviceGetCurrentClocksThrottleReasons"));
    init_ = init && by_pci_ && clock_ && max_clock_ && init() == 0;
  }
  bool init_ = false;
  ByPciFn by_pci_ = nullptr;
  ClockFn clock_ = nullptr, max_clock_ = nullptr;
  U64Fn energy_ = nullptr, reasons_ = nullptr;
  void* dev_ = nullptr;
};

constexpr int kNvmlClockSm = 1;
constexpr int kNvmlClockMem = 2;

}  // namespace

int nvml_sm_clock_mhz() { return Nvml::get().clock(kNvmlClockSm, false); }
int nvml_mem_clock_mhz() { return Nvml::get().clock(kNvmlClockMem, false); }
bool nvml_energy_mj(unsigned long long* mj) { return Nvml::get().energy_mj(mj); }
bool nvml_clock_event_reasons(unsigned long long* reasons) { return Nvml::get().reasons(reasons); }

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
    Nvml::get().bind(bus);
  }
  e.nvml_sm_clock_mhz = nvml_sm_clock_mhz();
  e.nvml_mem_clock_mhz = nvml_mem_clock_mhz();
  e.nvml_max_sm_clock_mhz = Nvml::get().clock(kNvmlClockSm, true);
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
