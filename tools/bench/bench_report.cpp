#include "bench_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>

namespace mxflash::bench {

// ---------------------------------------------------------------- statistics

Stats compute_stats(const std::vector<double>& v) {
  Stats s;
  s.n = int64_t(v.size());
  if (v.empty()) return s;
  std::vector<double> x(v);
  std::sort(x.begin(), x.end());
  s.min = x.front();
  s.max = x.back();
  const size_t n = x.size();
  s.median = n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
  s.mean = std::accumulate(x.begin(), x.end(), 0.0) / double(n);
  if (n > 1) {
    double ss = 0;
    for (double a : x) ss += (a - s.mean) * (a - s.mean);
    s.stdev = std::sqrt(ss / double(n - 1));
  }
  return s;
}

// ---------------------------------------------------------------- JSON writer

std::string json_escape(const std::string& s) {
  std::string o;
  o.reserve(s.size() + 2);
  for (unsigned char c : s) {
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\n': o += "\\n"; break;
      case '\r': o += "\\r"; break;
      case '\t': o += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          o += buf;
        } else {
          o += char(c);
        }
    }
  }
  return o;
}

void JsonWriter::newline() {
  out_ += '\n';
  out_.append(2 * stack_.size(), ' ');
}

void JsonWriter::before_value() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (stack_.empty()) return;
  Level& l = stack_.back();
  if (!l.empty) out_ += l.compact ? ", " : ",";
  if (!l.compact) newline();
  l.empty = false;
}

JsonWriter& JsonWriter::begin_object() {
  before_value();
  out_ += '{';
  stack_.push_back({false, false, true});
  return *this;
}

JsonWriter& JsonWriter::end_object() {
  const bool empty = stack_.back().empty;
  stack_.pop_back();
  if (!empty) newline();
  out_ += '}';
  return *this;
}

JsonWriter& JsonWriter::begin_array(bool compact) {
  before_value();
  out_ += '[';
  stack_.push_back({true, compact, true});
  return *this;
}

JsonWriter& JsonWriter::end_array() {
  const Level l = stack_.back();
  stack_.pop_back();
  if (!l.empty && !l.compact) newline();
  out_ += ']';
  return *this;
}

JsonWriter& JsonWriter::key(const std::string& k) {
  before_value();
  out_ += '"' + json_escape(k) + "\": ";
  after_key_ = true;
  return *this;
}

JsonWriter& JsonWriter::value(const std::string& v) {
  before_value();
  out_ += '"' + json_escape(v) + '"';
  return *this;
}

JsonWriter& JsonWriter::value(const char* v) { return value(std::string(v ? v : "")); }

JsonWriter& JsonWriter::value(double v) {
  before_value();
  if (!std::isfinite(v)) {
    out_ += "null";
  } else {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.10g", v);
    out_ += buf;
  }
  return *this;
}

JsonWriter& JsonWriter::value(int64_t v) {
  before_value();
  out_ += std::to_string(v);
  return *this;
}

JsonWriter& JsonWriter::value(uint64_t v) {
  before_value();
  out_ += std::to_string(v);
  return *this;
}

JsonWriter& JsonWriter::value(bool v) {
  before_value();
  out_ += v ? "true" : "false";
  return *this;
}

JsonWriter& JsonWriter::null() {
  before_value();
  out_ += "null";
  return *this;
}

JsonWriter& JsonWriter::kv_array(const std::string& k, const std::vector<double>& v) {
  key(k);
  begin_array(true);
  for (double x : v) value(x);
  return end_array();
}

JsonWriter& JsonWriter::kv_array(const std::string& k, const std::vector<int64_t>& v) {
  key(k);
  begin_array(true);
  for (int64_t x : v) value(x);
  return end_array();
}

// ---------------------------------------------------------------- results

double ImplResult::throughput() const {
  if (!ok() || stats.median <= 0) return 0;
  const double per_s = work / (stats.median * 1e-3);
  return unit == "TFLOP/s" ? per_s / 1e12 : per_s / 1e9;
}

double ImplResult::picojoules_per_work() const {
  if (!ok() || !power.valid() || work <= 0 || stats.median <= 0) return 0;
  return power.watts() * stats.median * 1e-3 / work * 1e12;
}

double ImplResult::best_throughput() const {
  if (!ok() || stats.min <= 0) return 0;
  const double per_s = work / (stats.min * 1e-3);
  return unit == "TFLOP/s" ? per_s / 1e12 : per_s / 1e9;
}

namespace {

void write_notes(JsonWriter& j, const std::string& name, const Notes& notes) {
  j.key(name).begin_object();
  for (const auto& [k, v] : notes) j.kv(k, v);
  j.end_object();
}

void write_lengths(JsonWriter& j, const std::string& name, const std::vector<int64_t>& l) {
  j.key(name).begin_object();
  int64_t sum = 0, mn = l.empty() ? 0 : l[0], mx = mn;
  for (int64_t x : l) sum += x, mn = std::min(mn, x), mx = std::max(mx, x);
  j.kv("count", int64_t(l.size()));
  j.kv("sum", sum);
  j.kv("min", mn);
  j.kv("max", mx);
  j.kv("mean", l.empty() ? 0.0 : double(sum) / double(l.size()));
  if (l.size() <= kMaxLengthsInJson) {
    j.kv_array("values", l);
  } else {
    j.kv("values", "omitted (batch too large): regenerate from spec + seed");
  }
  j.end_object();
}

void write_stats(JsonWriter& j, const Stats& s) {
  j.key("stats_ms").begin_object();
  j.kv("n", s.n);
  j.kv("median", s.median);
  j.kv("mean", s.mean);
  j.kv("min", s.min);
  j.kv("max", s.max);
  j.kv("stdev", s.stdev);
  j.end_object();
}

void write_result(JsonWriter& j, const ImplResult& r) {
  j.begin_object();
  j.kv("impl", r.impl);
  j.kv("direction", r.direction);
  j.kv("status", r.status);
  j.kv("message", r.message);
  write_notes(j, "notes", r.notes);
  j.kv("n_input_sets", r.n_sets);
  j.kv("input_set_bytes", r.set_bytes);
  j.kv("launches_per_sample", r.launches_per_sample);
  j.kv("warmup_s", r.warmup_s);
  j.kv("warmup_launches", r.warmup_launches);
  j.kv("work", r.work);
  j.kv("work_unit", r.unit == "TFLOP/s" ? "FLOP" : "byte");
  j.kv("unit", r.unit);
  j.kv("throughput_median", r.throughput());
  j.kv("throughput_best", r.best_throughput());
  write_stats(j, r.stats);
  j.key("power").begin_object();
  j.kv("source",
       "NVML total energy counter polled through the window, first to last change; energy per launch = board "
       "watts x median time; clocks and throttle reasons at each chunk end");
  j.kv("counter_steps", r.power.counter_steps);
  if (r.power.valid()) {
    j.kv("energy_j", r.power.energy_j);
    j.kv("wall_s", r.power.wall_s);
    j.kv("board_watts", r.power.watts());
    j.kv(r.unit == "TFLOP/s" ? "picojoules_per_flop" : "picojoules_per_byte", r.picojoules_per_work());
  } else {
    j.kv("energy_j", "unavailable");
  }
  j.kv("sm_clock_mhz_mean", r.power.sm_clock_mhz_mean);
  j.kv("clock_samples", r.power.clock_samples);
  j.kv("throttle_reasons", r.power.throttle_reasons);
  j.end_object();
  j.kv_array("samples_ms", r.samples_ms);
  j.key("check").begin_object();
  for (const auto& [k, v] : r.check) j.kv(k, v);
  j.end_object();
  j.end_object();
}

void write_case(JsonWriter& j, const CaseReport& c) {
  j.begin_object();
  j.kv("name", c.name);
  j.kv("workload", c.workload);
  j.key("shape").begin_object();
  j.kv("batch", c.batch);
  j.kv("heads", c.heads);
  j.kv("head_dim", c.head_dim);
  j.kv("broadcast_q", c.broadcast_q);
  j.kv("causal", c.causal);
  j.kv("lq_spec", c.lq_spec);
  j.kv("lk_spec", c.lk_spec);
  j.kv("seed", c.seed);
  write_lengths(j, "lengths_q", c.lq);
  write_lengths(j, "lengths_k", c.lk);
  j.end_object();
  j.key("flops").begin_object();
  j.kv("fwd", c.flops_fwd);
  j.kv("bwd", c.flops_bwd);
  j.kv("formula", c.causal == "none"
                      ? "fwd 4*H*D*sum_b(Lq_b*Lk_b), bwd 10*H*D*sum_b(Lq_b*Lk_b), real lengths"
                      : "fwd 4*H*D*P, bwd 10*H*D*P, P = sum_b sum_i n_b(i) the unmasked (row, key) pairs of the " +
                            c.causal + " causal mask, real lengths");
  j.end_object();
  write_notes(j, "notes", c.notes);
  j.key("results").begin_array();
  for (const ImplResult& r : c.results) write_result(j, r);
  j.end_array();
  j.end_object();
}

void write_env(JsonWriter& j, const EnvInfo& e) {
  j.key("environment").begin_object();
  j.kv("gpu", e.gpu_name);
  j.kv("device", e.device);
  j.kv("pci_bus_id", e.pci_bus_id);
  j.kv("sm_count", e.sm_count);
  j.kv("compute_capability", std::to_string(e.cc_major) + "." + std::to_string(e.cc_minor));
  j.kv("l2_bytes", e.l2_bytes);
  j.kv("memory_bytes", e.memory_bytes);
  j.kv("max_sm_clock_khz", e.max_sm_clock_khz);
  j.kv("max_mem_clock_khz", e.max_mem_clock_khz);
  j.kv("mem_bus_width_bits", e.mem_bus_width_bits);
  j.kv("nvml_sm_clock_mhz_at_start", e.nvml_sm_clock_mhz);
  j.kv("nvml_mem_clock_mhz_at_start", e.nvml_mem_clock_mhz);
  j.kv("nvml_max_sm_clock_mhz", e.nvml_max_sm_clock_mhz);
  j.kv("cuda_driver_version", e.driver_version);
  j.kv("cuda_runtime_version", e.runtime_version);
  j.kv("cudnn_version_runtime", e.cudnn_runtime_version);
  j.kv("cudnn_version_compiled", e.cudnn_compiled_version);
  j.kv("cudnn_frontend_version", e.cudnn_frontend_version);
  j.kv("hostname", e.hostname);
  j.kv("timestamp_utc", e.timestamp);
  j.end_object();
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace

std::string report_json(const BenchReport& r) {
  JsonWriter j;
  j.begin_object();
  j.kv("schema", "mxflash-bench/1");
  j.kv("command", r.command);
  write_env(j, r.env);
  j.key("protocol").begin_object();
  j.kv("warmup_s", r.warmup_s);
  j.kv("window_s", r.window_s);
  j.kv("launches_per_sample", r.launches);
  j.kv("timer", "cudaEventElapsedTime around each sample of launches; samples_ms are per launch");
  j.kv("cold_l2", "inputs rotated among n_input_sets sets whose total exceeds 2x L2 (at least 2 sets unless one set "
                  "exceeds 4x L2)");
  j.kv("check", r.check);
  j.kv("cudnn_layout", r.cudnn_layout);
  j.end_object();
  write_notes(j, "notes", r.notes);
  j.key("cases").begin_array();
  for (const CaseReport& c : r.cases) write_case(j, c);
  j.end_array();
  j.end_object();
  return j.str() + "\n";
}

std::string format_table(const BenchReport& r) {
  // Peers: every impl name that appears, in order of first appearance; columns left empty in every
  // row are dropped below.
  std::vector<std::string> peers;
  for (const CaseReport& c : r.cases)
    for (const ImplResult& x : c.results)
      if (std::find(peers.begin(), peers.end(), x.impl) == peers.end()) peers.push_back(x.impl);

  constexpr size_t kFixed = 10;  // case .. energy; then one column per peer; then the note
  std::vector<std::string> header = {"case",       "dir",  "impl", "median ms", "min ms", "stdev %",
                                     "throughput", "board W", "SM MHz", "pJ/work"};
  for (const std::string& p : peers) header.push_back("vs " + p);
  header.push_back("note");
  std::vector<std::vector<std::string>> rows;
  for (const CaseReport& c : r.cases) {
    for (const ImplResult& x : c.results) {
      std::vector<std::string> row = {c.name, x.direction, x.impl};
      if (!x.ok()) {
        row.insert(row.end(), {x.status, "", "", "", "", "", ""});
        row.resize(kFixed + peers.size(), "");
        row.push_back(x.message.size() > 90 ? x.message.substr(0, 87) + "..." : x.message);
        rows.push_back(row);
        continue;
      }
      row.push_back(fmt("%.4f", x.stats.median));
      row.push_back(fmt("%.4f", x.stats.min));
      row.push_back(fmt("%.2f", x.stats.median > 0 ? 100.0 * x.stats.stdev / x.stats.median : 0.0));
      row.push_back(fmt("%.1f", x.throughput()) + " " + x.unit);
      row.push_back(x.power.valid() ? fmt("%.0f", x.power.watts()) : "");
      row.push_back(x.power.sm_clock_mhz_mean > 0 ? fmt("%.0f", x.power.sm_clock_mhz_mean) : "");
      row.push_back(x.picojoules_per_work() > 0
                        ? fmt(x.unit == "TFLOP/s" ? "%.3f" : "%.1f", x.picojoules_per_work()) +
                              (x.unit == "TFLOP/s" ? " pJ/FLOP" : " pJ/B")
                        : "");
      for (const std::string& p : peers) {
        std::string cell;
        if (p != x.impl) {
          for (const ImplResult& y : c.results) {
            // attention rows compare within a direction; quantize rows with the copy of their case
            const bool comparable = c.workload == "quantize" ? y.impl == "copy" : y.direction == x.direction;
            if (y.impl == p && comparable && y.ok() && y.throughput() > 0) {
              cell = fmt("%.2fx", x.throughput() / y.throughput());
              break;
            }
          }
        }
        row.push_back(cell);
      }
      std::string note;
      for (const auto& [k, v] : x.notes)
        if (k == "layout") note = v;
      row.push_back(note);
      rows.push_back(row);
    }
  }
  // Drop the energy columns and peer columns that no row fills.
  std::vector<bool> keep(header.size(), true);
  for (size_t i = kFixed - 3; i < kFixed + peers.size(); ++i) {
    bool any = false;
    for (const auto& row : rows) any |= !row[i].empty();
    keep[i] = any;
  }
  bool any_note = false;
  for (const auto& row : rows) any_note |= !row.back().empty();
  keep.back() = any_note;

  std::vector<size_t> w(header.size());
  for (size_t i = 0; i < header.size(); ++i) w[i] = header[i].size();
  for (const auto& row : rows)
    for (size_t i = 0; i < row.size() && i < w.size(); ++i) w[i] = std::max(w[i], row[i].size());
  auto line = [&](const std::vector<std::string>& cells) {
    std::string s;
    for (size_t i = 0; i < w.size(); ++i) {
      if (!keep[i]) continue;
      const std::string cell = i < cells.size() ? cells[i] : "";
      const bool left = i < 3 || i + 1 == w.size();
      const std::string pad(w[i] - cell.size(), ' ');
      s += (s.empty() ? "" : "  ") + (left ? cell + pad : pad + cell);
    }
    while (!s.empty() && s.back() == ' ') s.pop_back();
    return s + "\n";
  };
  std::string out = line(header);
  size_t total = 0;
  for (size_t i = 0; i < w.size(); ++i)
    if (keep[i] && i + 1 != w.size()) total += w[i] + 2;
  out += std::string(total > 2 ? total - 2 : 0, '-') + "\n";
  std::string prev;
  for (const auto& row : rows) {
    if (!prev.empty() && row[0] != prev) out += "\n";
    prev = row[0];
    out += line(row);
  }
  return out;
}

}  // namespace mxflash::bench
