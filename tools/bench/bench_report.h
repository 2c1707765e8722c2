// mxflash-bench results: statistics, the JSON writer and document, and the printed table.
// CPU-only, in mxflash_bench_core, so the CPU tests check exactly what the binary writes.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mxflash::bench {

// ---------------------------------------------------------------- statistics
struct Stats {
  int64_t n = 0;
  double mean = 0, median = 0, min = 0, max = 0;
  double stdev = 0;  // sample standard deviation (n - 1); 0 for n < 2
};
Stats compute_stats(const std::vector<double>& v);

// ---------------------------------------------------------------- JSON writer
// A small streaming writer: escapes strings, writes non-finite numbers as null, tracks commas.
// Objects are written one member per line; arrays opened with compact=true stay on one line.
class JsonWriter {
 public:
  JsonWriter& begin_object();
  JsonWriter& end_object();
  JsonWriter& begin_array(bool compact = false);
  JsonWriter& end_array();
  JsonWriter& key(const std::string& k);
  JsonWriter& value(const std::string& v);
  JsonWriter& value(const char* v);
  JsonWriter& value(double v);
  JsonWriter& value(int64_t v);
  JsonWriter& value(uint64_t v);
  JsonWriter& value(int v) { return value(int64_t(v)); }
  JsonWriter& value(bool v);
  JsonWriter& null();
  template <typename T>
  JsonWriter& kv(const std::string& k, const T& v) {
    key(k);
    return value(v);
  }
  JsonWriter& kv_array(const std::string& k, const std::vector<double>& v);
  JsonWriter& kv_array(const std::string& k, const std::vector<int64_t>& v);
  const std::string& str() const { return out_; }
  bool complete() const { return stack_.empty() && !out_.empty(); }

 private:
  struct Level {
    bool array;
    bool compact;
    bool empty;
  };
  void before_value();
  void newline();
  std::string out_;
  std::vector<Level> stack_;
  bool after_key_ = false;
};

std::string json_escape(const std::string& s);

// ---------------------------------------------------------------- results
using Notes = std::vector<std::pair<std::string, std::string>>;

struct EnvInfo {
  std::string gpu_name = "unknown";
  int device = 0;
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  int64_t l2_bytes = 0;
  int64_t memory_bytes = 0;
  int max_sm_clock_khz = 0;   // cudaDevAttrClockRate
  int max_mem_clock_khz = 0;  // cudaDevAttrMemoryClockRate
  int mem_bus_width_bits = 0;
  int nvml_sm_clock_mhz = -1;  // current clocks read through NVML when available, at the start
  int nvml_mem_clock_mhz = -1;
  int nvml_max_sm_clock_mhz = -1;
  int driver_version = 0;   // cudaDriverGetVersion
  int runtime_version = 0;  // cudaRuntimeGetVersion
  int64_t cudnn_runtime_version = 0;   // cudnnGetVersion() at run time (0: not built with cuDNN)
  int64_t cudnn_compiled_version = 0;  // CUDNN_VERSION of the headers
  std::string cudnn_frontend_version;  // of the headers
  std::string pci_bus_id;
  std::string hostname;
  std::string timestamp;  // UTC, ISO 8601
};

struct ImplResult {
  std::string impl;       // cudnn-bf16, cudnn-fp8, mxfp8, mxfp8-exec, copy
  std::string direction;  // fwd, bwd; for quantize: the orientation, or "copy"
  std::string status = "ok";  // ok | unsupported | error | skipped
  std::string message;
  Notes notes;  // layout, dtypes, scales, plan name...
  int n_sets = 1;          // input sets rotated for a cold L2
  int64_t set_bytes = 0;   // bytes of one input set
  int launches_per_sample = 0;
  double warmup_s = 0;
  int64_t warmup_launches = 0;
  std::vector<double> samples_ms;  // per launch, one entry per CUDA-event sample
  Stats stats;                     // of samples_ms
  double work = 0;                 // FLOPs (attention) or bytes read + written (quantize, copy)
  std::string unit;                // "TFLOP/s" or "GB/s"
  std::vector<std::pair<std::string, double>> check;  // --check numbers (cosines, ...)
  // The board's power over the sampling window, from NVML's total-energy counter: a thread polls
  // it every millisecond through the window and keeps the first and last changes it sees (the
  // counter moves in ~100 ms steps on the H200), so energy_j / wall_s is the mean power between
  // them, all of it with the stream busy. The SM clock and the clock-event (throttle) reasons are
  // sampled at each chunk's end. energy_j < 0 where NVML is not available or the window saw fewer
  // than two changes. At a power cap, speed is work per joule, so the energy per unit of work
  // (power x median time / work) is the number that compares kernels across clocks and cards.
  struct Power {
    double energy_j = -1;
    double wall_s = 0;
    int64_t counter_steps = 0;      // changes of the counter seen in the window
    double sm_clock_mhz_mean = -1;  // mean of the samples; -1 without samples
    int64_t clock_samples = 0;
    uint64_t throttle_reasons = 0;  // OR of the samples' reasons (NVML bit mask; 0x4: SW power cap)
    bool valid() const { return energy_j > 0 && wall_s > 0; }
    double watts() const { return valid() ? energy_j / wall_s : 0; }
  } power;
  bool ok() const { return status == "ok" && !samples_ms.empty(); }
  // Board energy per launch (mean power x median time) over the launch's work, in pJ per FLOP
  // (attention) or per byte (quantize, copy); 0 when unknown.
  double picojoules_per_work() const;
  // work / median time, in `unit` (TFLOP/s = 1e12 FLOP/s, GB/s = 1e9 B/s)
  double throughput() const;
  double best_throughput() const;  // from the minimum time
};

struct CaseReport {
  std::string name;
  std::string workload;  // attention | quantize
  int64_t batch = 0, heads = 0, head_dim = 128;
  bool broadcast_q = false;
  std::string causal = "none";  // none | top_left | bottom_right (attention; FLOPs count unmasked pairs)
  std::string lq_spec, lk_spec;
  uint64_t seed = 0;
  std::vector<int64_t> lq, lk;  // realized lengths (quantize: lk holds the token lengths)
  double flops_fwd = 0, flops_bwd = 0;
  Notes notes;
  std::vector<ImplResult> results;
};

struct BenchReport {
  std::string command;  // to reproduce
  EnvInfo env;
  double warmup_s = 1, window_s = 5;
  int launches = 5;
  bool check = false;
  std::string cudnn_layout;
  Notes notes;
  std::vector<CaseReport> cases;
};

// Lengths arrays are written in full up to this batch; beyond, seed + summary only.
inline constexpr size_t kMaxLengthsInJson = 4096;

std::string report_json(const BenchReport& r);

// The table printed last: one row per (case, direction, impl), median ms, throughput, and the
// throughput ratio to every other impl of the same case and direction ("1.42x" = this one faster).
std::string format_table(const BenchReport& r);

}  // namespace mxflash::bench
