#include "nvml.h"

#include <dlfcn.h>

namespace mxflash::tools {
namespace {

class Nvml {
 public:
  static Nvml& get() {
    static Nvml n;
    return n;
  }
  bool bind(const char* pci_bus_id) {
    if (!init_) return false;
    if (!dev_ && by_pci_(pci_bus_id, &dev_) != 0) dev_ = nullptr;
    return dev_ != nullptr;
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
    // Optional: the energy counter (Volta and newer) and the clock-event reasons, under their newer
    // name first.
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

}  // namespace

bool nvml_bind(const char* pci_bus_id) { return Nvml::get().bind(pci_bus_id); }
int nvml_clock_mhz(int type, bool max) { return Nvml::get().clock(type, max); }
bool nvml_energy_mj(unsigned long long* mj) { return Nvml::get().energy_mj(mj); }
bool nvml_clock_event_reasons(unsigned long long* reasons) { return Nvml::get().reasons(reasons); }

void EnergyWindow::start() {
  stop();
  stop_ = false;
  steps_ = 0;
  unsigned long long e0 = 0;
  if (!nvml_energy_mj(&e0)) return;
  poller_ = std::thread([this, e0]() {
    unsigned long long prev = e0, e = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      if (nvml_energy_mj(&e) && e != prev) {
        const Clock::time_point t = Clock::now();
        if (steps_ == 0) first_ = e, t_first_ = t;
        last_ = e, t_last_ = t;
        prev = e;
        ++steps_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
}

EnergyWindow::Result EnergyWindow::stop() {
  stop_ = true;
  if (poller_.joinable()) poller_.join();
  Result r;
  r.steps = steps_;
  if (steps_ >= 2 && last_ > first_) {
    r.energy_j = double(last_ - first_) * 1e-3;
    r.wall_s = std::chrono::duration<double>(t_last_ - t_first_).count();
  }
  return r;
}

}  // namespace mxflash::tools
