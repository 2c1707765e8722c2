// NVML for the command-line tools, resolved at run time (dlopen of libnvidia-ml.so.1, so no NVML is
// needed to build): current and maximum clocks, the clock-event (throttle) reasons, and the board's
// energy counter read around a window of work (EnergyWindow).
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace mxflash::tools {

inline constexpr int kNvmlClockSm = 1;
inline constexpr int kNvmlClockMem = 2;

// Binds the device with this PCI bus id (cudaDeviceGetPCIBusId); false without NVML or the device.
bool nvml_bind(const char* pci_bus_id);
// A clock (kNvmlClockSm / kNvmlClockMem) in MHz, current or maximum; -1 when unknown.
int nvml_clock_mhz(int type, bool max);
// The board's energy counter in mJ (since the driver loaded); false when not available.
bool nvml_energy_mj(unsigned long long* mj);
// The current clock-event (throttle) reasons mask (0x4: the software power cap); false when not available.
bool nvml_clock_event_reasons(unsigned long long* reasons);

// The board's mean power over a window of work: a thread polls the energy counter every
// millisecond from start() to stop() and keeps the first and last changes it sees (the H200's
// counter moves every ~100 ms), so energy_j / wall_s is the mean power between them, all of it
// inside the window. Invalid (energy_j < 0) without NVML or with fewer than two changes.
class EnergyWindow {
 public:
  struct Result {
    double energy_j = -1;
    double wall_s = 0;
    int64_t steps = 0;  // changes of the counter seen
    bool valid() const { return energy_j > 0 && wall_s > 0; }
    double watts() const { return valid() ? energy_j / wall_s : 0; }
  };
  EnergyWindow() = default;
  EnergyWindow(const EnergyWindow&) = delete;
  EnergyWindow& operator=(const EnergyWindow&) = delete;
  ~EnergyWindow() { stop(); }
  void start();
  Result stop();

 private:
  using Clock = std::chrono::steady_clock;
  std::atomic<bool> stop_{false};
  std::thread poller_;
  unsigned long long first_ = 0, last_ = 0;
  Clock::time_point t_first_, t_last_;
  int64_t steps_ = 0;
};

}  // namespace mxflash::tools
