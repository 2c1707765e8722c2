#include "bench_harness.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "bench_cuda.h"
#include "bench_env.h"
#include "nvml.h"

namespace mxflash::bench {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

constexpr double kWarmupChunkS = 0.1;   // synchronize about this often while warming up
constexpr double kSampleChunkS = 0.25;  // samples enqueued between synchronizations
constexpr int kMaxSamplesPerChunk = 256;
constexpr int kMinSamples = 3;
constexpr double kProgressEveryS = 5.0;

class EventPool {
 public:
  ~EventPool() {
    for (cudaEvent_t e : ev_) cudaEventDestroy(e);
  }
  Status ensure(size_t n) {
    while (ev_.size() < n) {
      cudaEvent_t e;
      BENCH_CUDA(cudaEventCreate(&e));
      ev_.push_back(e);
    }
    return Status::Ok();
  }
  cudaEvent_t operator[](size_t i) const { return ev_[i]; }

 private:
  std::vector<cudaEvent_t> ev_;
};

}  // namespace

int input_sets_for(int64_t set_bytes, int64_t l2_bytes) {
  if (set_bytes <= 0) return 1;
  int64_t n = (2 * l2_bytes + set_bytes - 1) / set_bytes;
  n = std::max<int64_t>(n, 1);
  if (n == 1 && set_bytes < 4 * l2_bytes) n = 2;
  return int(std::min<int64_t>(n, 4096));
}

Status measure(const LaunchFn& launch, int n_sets, const Protocol& p, cudaStream_t stream, const std::string& label,
               ImplResult* out) {
  int64_t counter = 0;
  auto next = [&]() { return int(counter++ % std::max(n_sets, 1)); };

  // Warm-up by time; at least two launches (the first may carry lazy initialization).
  const Clock::time_point w0 = Clock::now();
  int64_t warm = 0;
  int chunk = 1;
  double est_s = 0;  // seconds per launch
  do {
    const Clock::time_point t = Clock::now();
    for (int i = 0; i < chunk; ++i) MXFLASH_RETURN_IF_ERROR(launch(next()));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    est_s = std::max(seconds_since(t) / chunk, 1e-7);
    warm += chunk;
    chunk = int(std::clamp(kWarmupChunkS / est_s, 1.0, 1000.0));
  } while (warm < 2 || seconds_since(w0) < p.warmup_s);
  out->warmup_s = seconds_since(w0);
  out->warmup_launches = warm;

  // The board's power over the window (ImplResult::Power; stopped on every return below).
  ImplResult::Power power;
  tools::EnergyWindow energy;
  energy.start();
  double clock_sum = 0;
  auto sample_clocks = [&]() {
    const int mhz = nvml_sm_clock_mhz();
    if (mhz > 0) {
      clock_sum += mhz;
      ++power.clock_samples;
    }
    unsigned long long reasons = 0;
    if (tools::nvml_clock_event_reasons(&reasons)) power.throttle_reasons |= reasons;
  };
  EventPool ev;
  const Clock::time_point m0 = Clock::now();
  double last_progress = 0;
  out->samples_ms.clear();
  out->launches_per_sample = p.launches;
  out->n_sets = n_sets;
  for (;;) {
    const int k = int(std::clamp(kSampleChunkS / (est_s * p.launches), 1.0, double(kMaxSamplesPerChunk)));
    MXFLASH_RETURN_IF_ERROR(ev.ensure(2 * size_t(k)));
    MXFLASH_RETURN_IF_ERROR(launch(next()));  // lead launch: the stream is busy when the first event lands
    for (int i = 0; i < k; ++i) {
      BENCH_CUDA(cudaEventRecord(ev[2 * i], stream));
      for (int j = 0; j < p.launches; ++j) MXFLASH_RETURN_IF_ERROR(launch(next()));
      BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], stream));
    }
    BENCH_CUDA(cudaEventSynchronize(ev[2 * k - 1]));
    sample_clocks();
    for (int i = 0; i < k; ++i) {
      float ms = 0;
      BENCH_CUDA(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
      out->samples_ms.push_back(double(ms) / p.launches);
    }
    est_s = std::max(out->samples_ms.back() * 1e-3, 1e-7);
    const double elapsed = seconds_since(m0);
    if (elapsed - last_progress >= kProgressEveryS) {
      last_progress = elapsed;
      std::fprintf(stderr, "[mxflash-bench]   %s: %.0f s, %zu samples, last %.4f ms\n", label.c_str(), elapsed,
                   out->samples_ms.size(), out->samples_ms.back());
    }
    if (elapsed >= p.window_s && out->samples_ms.size() >= size_t(kMinSamples)) break;
  }
  const tools::EnergyWindow::Result e = energy.stop();
  power.counter_steps = e.steps;
  if (e.valid()) {
    power.energy_j = e.energy_j;
    power.wall_s = e.wall_s;
  }
  if (power.clock_samples > 0) power.sm_clock_mhz_mean = clock_sum / double(power.clock_samples);
  out->power = power;
  out->stats = compute_stats(out->samples_ms);
  return Status::Ok();
}

}  // namespace mxflash::bench
