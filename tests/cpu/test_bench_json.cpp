// mxflash-bench JSON: the document parses back (a small strict JSON parser below) and carries the
// keys the protocol requires; the table prints every row and the ratios to each peer.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_report.h"

namespace mxflash::bench {
namespace {

// ---------------------------------------------------------------- a tiny strict JSON parser
struct JValue {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  double number = 0;
  bool boolean = false;
  std::string str;
  std::vector<JValue> items;
  std::vector<std::pair<std::string, JValue>> members;
  const JValue* get(const std::string& k) const {
    for (const auto& [key, v] : members)
      if (key == k) return &v;
    return nullptr;
  }
};

class Parser {
 public:
  explicit Parser(const std::string& s) : s_(s) {}
  bool parse(JValue* out) {
    if (!value(out)) return false;
    ws();
    return i_ == s_.size();
  }
  std::string error() const { return "at offset " + std::to_string(i_); }

 private:
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  bool lit(const char* w) {
    const std::string x(w);
    if (s_.compare(i_, x.size(), x) != 0) return false;
    i_ += x.size();
    return true;
  }
  bool string(std::string* out) {
    if (s_[i_] != '"') return false;
    ++i_;
    while (i_ < s_.size() && s_[i_] != '"') {
      const unsigned char c = s_[i_];
      if (c < 0x20) return false;
      if (c == '\\') {
        ++i_;
        if (i_ >= s_.size()) return false;
        const char e = s_[i_];
        if (e == 'u') {
          if (i_ + 4 >= s_.size()) return false;
          for (int k = 1; k <= 4; ++k)
            if (!std::isxdigit(static_cast<unsigned char>(s_[i_ + k]))) return false;
          i_ += 4;
          *out += '?';
        } else if (std::string("\"\\/").find(e) != std::string::npos) {
          *out += e;
        } else if (std::string("bfnrt").find(e) != std::string::npos) {
          *out += "\b\f\n\r\t"[std::string("bfnrt").find(e)];
        } else {
          return false;
        }
      } else {
        *out += char(c);
      }
      ++i_;
    }
    if (i_ >= s_.size()) return false;
    ++i_;
    return true;
  }
  bool number(double* out) {
    const size_t start = i_;
    if (s_[i_] == '-') ++i_;
    if (i_ >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[i_]))) return false;
    if (s_[i_] == '0' && i_ + 1 < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_ + 1]))) return false;
    while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    if (i_ < s_.size() && s_[i_] == '.') {
      ++i_;
      if (i_ >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[i_]))) return false;
      while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      if (i_ >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[i_]))) return false;
      while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    }
    *out = std::stod(s_.substr(start, i_ - start));
    return true;
  }
  bool value(JValue* v) {
    ws();
    if (i_ >= s_.size()) return false;
    const char c = s_[i_];
    if (c == '{') {
      v->kind = JValue::kObject;
      ++i_;
      ws();
      if (i_ < s_.size() && s_[i_] == '}') return ++i_, true;
      for (;;) {
        ws();
        std::string k;
        if (i_ >= s_.size() || !string(&k)) return false;
        for (const auto& m : v->members)
          if (m.first == k) return false;  // duplicate key
        ws();
        if (i_ >= s_.size() || s_[i_] != ':') return false;
        ++i_;
        JValue x;
        if (!value(&x)) return false;
        v->members.push_back({k, std::move(x)});
        ws();
        if (i_ < s_.size() && s_[i_] == ',') {
          ++i_;
          continue;
        }
        if (i_ < s_.size() && s_[i_] == '}') return ++i_, true;
        return false;
      }
    }
    if (c == '[') {
      v->kind = JValue::kArray;
      ++i_;
      ws();
      if (i_ < s_.size() && s_[i_] == ']') return ++i_, true;
      for (;;) {
        JValue x;
        if (!value(&x)) return false;
        v->items.push_back(std::move(x));
        ws();
        if (i_ < s_.size() && s_[i_] == ',') {
          ++i_;
          continue;
        }
        if (i_ < s_.size() && s_[i_] == ']') return ++i_, true;
        return false;
      }
    }
    if (c == '"') return v->kind = JValue::kString, string(&v->str);
    if (lit("true")) return v->kind = JValue::kBool, v->boolean = true, true;
    if (lit("false")) return v->kind = JValue::kBool, true;
    if (lit("null")) return v->kind = JValue::kNull, true;
    v->kind = JValue::kNumber;
    return number(&v->number);
  }
  const std::string& s_;
  size_t i_ = 0;
};

BenchReport sample_report() {
  BenchReport r;
  r.command = "mxflash-bench --preset llm --json 'a \"b\".json'";
  r.env.gpu_name = "NVIDIA H200";
  r.env.sm_count = 132;
  r.env.cc_major = 9;
  r.env.l2_bytes = 62914560;
  r.env.cudnn_runtime_version = 91900;
  r.env.cudnn_compiled_version = 91900;
  r.env.cudnn_frontend_version = "1.32.0";
  r.cudnn_layout = "auto";
  CaseReport c;
  c.name = "llm";
  c.workload = "attention";
  c.batch = 2;
  c.heads = 16;
  c.lq = {2048, 2048};
  c.lk = {2048, 2048};
  c.flops_fwd = 4.0 * 16 * 128 * 2 * 2048.0 * 2048;
  c.flops_bwd = 2.5 * c.flops_fwd;
  for (const char* impl : {"cudnn-bf16", "cudnn-fp8"}) {
    ImplResult x;
    x.impl = impl;
    x.direction = "fwd";
    x.unit = "TFLOP/s";
    x.work = c.flops_fwd;
    x.samples_ms = std::string(impl) == "cudnn-bf16" ? std::vector<double>{0.2, 0.21, 0.19}
                                                     : std::vector<double>{0.1, 0.1, 0.1};
    x.stats = compute_stats(x.samples_ms);
    x.notes = {{"layout", "dense"}, {"weird", "tab\there\nnewline \x01"}};
    x.check = {{"cos_O_vs_cudnn-bf16", 0.9991}, {"nan", std::nan("")}};
    if (std::string(impl) == "cudnn-fp8") {  // 700 W over 2.5 s: 0.07 J a 0.1 ms launch
      x.power.energy_j = 1750;
      x.power.wall_s = 2.5;
      x.power.counter_steps = 26;
      x.power.sm_clock_mhz_mean = 1845;
      x.power.clock_samples = 4;
      x.power.throttle_reasons = 4;
    }
    c.results.push_back(x);
  }
  ImplResult m;
  m.impl = "mxfp8";
  m.direction = "fwd";
  m.status = "unsupported";
  m.message = "not implemented yet";
  c.results.push_back(m);
  r.cases.push_back(c);
  CaseReport big;
  big.name = "jagged";
  big.workload = "attention";
  big.lk.assign(kMaxLengthsInJson + 1, 3);
  r.cases.push_back(big);
  return r;
}

TEST(BenchJson, ParsesBackWithRequiredKeys) {
  const std::string doc = report_json(sample_report());
  JValue root;
  Parser p(doc);
  ASSERT_TRUE(p.parse(&root)) << p.error() << "\n" << doc;
  ASSERT_EQ(root.kind, JValue::kObject);
  for (const char* k : {"schema", "command", "environment", "protocol", "notes", "cases"})
    EXPECT_NE(root.get(k), nullptr) << k;
  EXPECT_EQ(root.get("command")->str, "mxflash-bench --preset llm --json 'a \"b\".json'");
  const JValue* env = root.get("environment");
  for (const char* k : {"gpu", "sm_count", "compute_capability", "l2_bytes", "max_sm_clock_khz", "max_mem_clock_khz",
                        "cuda_runtime_version", "cuda_driver_version", "cudnn_version_runtime",
                        "cudnn_version_compiled", "cudnn_frontend_version", "timestamp_utc"})
    EXPECT_NE(env->get(k), nullptr) << k;
  EXPECT_EQ(env->get("gpu")->str, "NVIDIA H200");
  const JValue* proto = root.get("protocol");
  for (const char* k : {"warmup_s", "window_s", "launches_per_sample", "timer", "cold_l2"})
    EXPECT_NE(proto->get(k), nullptr) << k;

  const JValue& cases = *root.get("cases");
  ASSERT_EQ(cases.items.size(), 2u);
  const JValue& c = cases.items[0];
  for (const char* k : {"name", "workload", "shape", "flops", "results"}) EXPECT_NE(c.get(k), nullptr) << k;
  const JValue* shape = c.get("shape");
  for (const char* k : {"batch", "heads", "head_dim", "broadcast_q", "seed", "lengths_q", "lengths_k"})
    EXPECT_NE(shape->get(k), nullptr) << k;
  EXPECT_EQ(shape->get("lengths_k")->get("values")->items.size(), 2u);
  EXPECT_EQ(shape->get("lengths_k")->get("sum")->number, 4096);
  const JValue& res = *c.get("results");
  ASSERT_EQ(res.items.size(), 3u);
  for (const char* k : {"impl", "direction", "status", "notes", "samples_ms", "stats_ms", "throughput_median",
                        "n_input_sets", "input_set_bytes", "launches_per_sample", "check", "work"})
    EXPECT_NE(res.items[0].get(k), nullptr) << k;
  EXPECT_EQ(res.items[0].get("samples_ms")->items.size(), 3u);
  EXPECT_DOUBLE_EQ(res.items[0].get("stats_ms")->get("median")->number, 0.2);
  EXPECT_EQ(res.items[1].get("check")->get("nan")->kind, JValue::kNull);  // NaN written as null
  EXPECT_EQ(res.items[0].get("notes")->get("weird")->str.substr(0, 8), "tab\there");
  EXPECT_EQ(res.items[2].get("status")->str, "unsupported");
  // Energy: the fp8 row carries its NVML window, the bf16 row says it has none.
  const JValue* pw = res.items[1].get("power");
  ASSERT_NE(pw, nullptr);
  EXPECT_NEAR(pw->get("board_watts")->number, 700.0, 1e-9);
  const double flops = 4.0 * 16 * 128 * 2 * 2048.0 * 2048;
  EXPECT_NEAR(pw->get("picojoules_per_flop")->number, 700.0 * 0.1e-3 / flops * 1e12, 1e-9);
  EXPECT_EQ(pw->get("counter_steps")->number, 26);
  EXPECT_EQ(pw->get("throttle_reasons")->number, 4);
  EXPECT_EQ(pw->get("sm_clock_mhz_mean")->number, 1845);
  EXPECT_EQ(res.items[0].get("power")->get("energy_j")->str, "unavailable");
  EXPECT_EQ(res.items[0].get("power")->get("picojoules_per_flop"), nullptr);
  // Large batches: summary only.
  const JValue* big_k = cases.items[1].get("shape")->get("lengths_k");
  EXPECT_EQ(big_k->get("values")->kind, JValue::kString);
  EXPECT_EQ(big_k->get("count")->number, double(kMaxLengthsInJson + 1));
}

TEST(BenchJson, WriterRejectsNothingAndBalances) {
  JsonWriter j;
  j.begin_object().kv("a", int64_t(1)).key("b").begin_array(true).value(1.5).value("x").null().end_array();
  j.key("c").begin_object().end_object().key("d").begin_array().end_array().end_object();
  EXPECT_TRUE(j.complete());
  JValue v;
  Parser p(j.str());
  EXPECT_TRUE(p.parse(&v)) << j.str();
  EXPECT_EQ(v.get("b")->items.size(), 3u);
  EXPECT_EQ(json_escape("\"\\\n"), "\\\"\\\\\\n");
}

TEST(BenchTable, RowsAndRatios) {
  const std::string t = format_table(sample_report());
  EXPECT_NE(t.find("vs cudnn-bf16"), std::string::npos) << t;
  EXPECT_NE(t.find("vs cudnn-fp8"), std::string::npos) << t;
  EXPECT_NE(t.find("2.00x"), std::string::npos) << t;  // fp8 0.1 ms vs bf16 0.2 ms
  EXPECT_NE(t.find("0.50x"), std::string::npos) << t;
  EXPECT_NE(t.find("unsupported"), std::string::npos) << t;
  EXPECT_NE(t.find("TFLOP/s"), std::string::npos) << t;
  EXPECT_NE(t.find("median ms"), std::string::npos) << t;
  EXPECT_NE(t.find("1.019 pJ/FLOP"), std::string::npos) << t;  // 700 W x 0.1 ms / 6.9e10 FLOP
  EXPECT_NE(t.find("board W"), std::string::npos) << t;
  EXPECT_NE(t.find(" 700 "), std::string::npos) << t;
  EXPECT_NE(t.find("1845"), std::string::npos) << t;
}

TEST(BenchTable, EnergyColumnsOnlyWithEnergy) {
  BenchReport r = sample_report();
  for (CaseReport& c : r.cases)
    for (ImplResult& x : c.results) x.power = ImplResult::Power{};
  const std::string t = format_table(r);
  EXPECT_EQ(t.find("board W"), std::string::npos) << t;
  EXPECT_EQ(t.find("pJ/"), std::string::npos) << t;
  EXPECT_NE(t.find("2.00x"), std::string::npos) << t;  // the peer columns stay where they were
}

TEST(BenchPower, PicojoulesPerWork) {
  ImplResult x;
  x.unit = "GB/s";
  x.work = 2e9;  // bytes per launch
  x.samples_ms = {1.0};
  x.stats = compute_stats(x.samples_ms);
  EXPECT_EQ(x.picojoules_per_work(), 0.0);  // no NVML window
  x.power.energy_j = 30.0;
  x.power.wall_s = 0.1;  // 300 W x 1 ms = 0.3 J a launch over 2e9 bytes
  EXPECT_NEAR(x.picojoules_per_work(), 150.0, 1e-9);
  EXPECT_NEAR(x.power.watts(), 300.0, 1e-9);
  x.power.wall_s = 0;  // fewer than two counter changes: unknown
  EXPECT_EQ(x.picojoules_per_work(), 0.0);
  x.power.wall_s = 0.1;
  x.status = "error";
  EXPECT_EQ(x.picojoules_per_work(), 0.0);
}

}  // namespace
}  // namespace mxflash::bench
