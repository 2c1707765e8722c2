// The accuracy suite behind mxflash-accuracy (src/reference/accuracy_suite): metrics, verdicts,
// argument parsing, input distributions, JSON, and a small end-to-end CLI run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "reference/accuracy_suite.h"

namespace mxflash::accuracy {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<double> ramp(int n) {
  std::vector<double> x(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) x[i] = std::sin(0.37 * i) + 0.1 * i;
  return x;
}

TEST(AccuracyMetrics, RelativeErrorGivesKnownSqnr) {
  const std::vector<double> ref = ramp(1000);
  for (double eps : {1e-1, 1e-2, 1e-3, 1e-6}) {
    std::vector<double> out = ref;
    for (double& x : out) x *= 1 + eps;
    const ErrorStats s = compare(ref, out);
    EXPECT_NEAR(s.sqnr_db, -20 * std::log10(eps), 1e-6) << eps;
    EXPECT_NEAR(s.cosine, 1.0, 1e-12);
    EXPECT_LE(s.max_rel_err, eps * (1 + 1e-9));  // |err| / max(|ref|, 1)
    EXPECT_GT(s.max_rel_err, 0.5 * eps);
    EXPECT_EQ(s.count, 1000);
  }
  // Additive noise orthogonal to ref: SQNR from the norm ratio; cosine = 1/sqrt(1 + 1/snr).
  const std::vector<double> r{1, 0, 1, 0}, o{1, 0.1, 1, -0.1};
  const ErrorStats s = compare(r, o);
  EXPECT_NEAR(s.sqnr_db, 10 * std::log10(2 / 0.02), 1e-9);
  EXPECT_NEAR(s.cosine, 1 / std::sqrt(1 + 0.01), 1e-12);
}

TEST(AccuracyMetrics, ExactZeroAndNonFinite) {
  const std::vector<double> ref = ramp(10);
  ErrorStats s = compare(ref, ref);
  EXPECT_EQ(s.sqnr_db, kInf);
  EXPECT_NEAR(s.cosine, 1.0, 1e-15);
  EXPECT_EQ(s.max_rel_err, 0.0);
  // Both zero: exact; ref zero but output not: -inf dB, cosine 0.
  s = compare({0, 0}, {0, 0});
  EXPECT_EQ(s.sqnr_db, kInf);
  EXPECT_EQ(s.cosine, 1.0);
  s = compare({0, 0}, {0, 1e-3});
  EXPECT_EQ(s.sqnr_db, -kInf);
  EXPECT_EQ(s.cosine, 0.0);
  // Equal -inf pairs (LSE rows without keys) are skipped; a mismatch poisons the metrics.
  s = compare({-kInf, 2.0, 3.0}, {-kInf, 2.0, 3.0});
  EXPECT_EQ(s.count, 2);
  EXPECT_EQ(s.mismatched, 0);
  EXPECT_EQ(s.sqnr_db, kInf);
  s = compare({-kInf, 2.0}, {1.0, 2.0});
  EXPECT_EQ(s.mismatched, 1);
  EXPECT_TRUE(std::isnan(s.sqnr_db));
  s = compare({1.0, 2.0}, {1.0, std::nan("")});
  EXPECT_EQ(s.mismatched, 1);
  s = compare({1.0}, {1.0, 2.0});
  EXPECT_GT(s.mismatched, 0);
}

ErrorStats stats(double sqnr, double cos) {
  ErrorStats s;
  s.sqnr_db = sqnr;
  s.cosine = cos;
  s.count = 1;
  return s;
}

TEST(AccuracyVerdict, FloorsAndBorderline) {
  const Thresholds th;  // out 0.98 / 8 dB, dQ 0.97 / 10 dB, border 1 dB / 0.005
  EXPECT_EQ(judge(Tensor::kOut, stats(25, 0.998), th), Verdict::kPass);
  EXPECT_EQ(judge(Tensor::kOut, stats(8.5, 0.998), th), Verdict::kBorderline);   // within 1 dB
  EXPECT_EQ(judge(Tensor::kOut, stats(25, 0.984), th), Verdict::kBorderline);    // within 0.005
  EXPECT_EQ(judge(Tensor::kOut, stats(8.0, 0.998), th), Verdict::kFail);         // at the floor
  EXPECT_EQ(judge(Tensor::kOut, stats(25, 0.98), th), Verdict::kFail);
  EXPECT_EQ(judge(Tensor::kDq, stats(10.5, 0.999), th), Verdict::kBorderline);   // dQ floor is 10 dB
  EXPECT_EQ(judge(Tensor::kDq, stats(9.9, 0.999), th), Verdict::kFail);
  EXPECT_EQ(judge(Tensor::kDk, stats(9.9, 0.999), th), Verdict::kPass);          // dK floor is 8 dB
  EXPECT_EQ(judge(Tensor::kDv, stats(std::nan(""), 0.999), th), Verdict::kFail);
  EXPECT_EQ(judge(Tensor::kDv, stats(kInf, 1.0), th), Verdict::kPass);
  ErrorStats bad = stats(30, 0.999);
  bad.mismatched = 1;
  EXPECT_EQ(judge(Tensor::kOut, bad, th), Verdict::kFail);
  // LSE is not judged by default; with a limit, on its max relative error.
  ErrorStats lse = stats(60, 1.0);
  lse.max_rel_err = 0.02;
  EXPECT_EQ(judge(Tensor::kLse, lse, th), Verdict::kNone);
  Thresholds t2 = th;
  t2.lse_max_rel = 0.05;
  EXPECT_EQ(judge(Tensor::kLse, lse, t2), Verdict::kPass);
  t2.lse_max_rel = 0.03;
  EXPECT_EQ(judge(Tensor::kLse, lse, t2), Verdict::kBorderline);
  t2.lse_max_rel = 0.01;
  EXPECT_EQ(judge(Tensor::kLse, lse, t2), Verdict::kFail);
}

Status parse(std::vector<std::string> args, Config* cfg, bool* help = nullptr) {
  bool h = false;
  const Status s = parse_args(args, cfg, help ? help : &h);
  return s;
}

TEST(AccuracyArgs, Defaults) {
  Config cfg;
  ASSERT_TRUE(parse({}, &cfg).ok());
  EXPECT_EQ(cfg.heads, 2);
  EXPECT_EQ(cfg.lengths, (std::vector<int64_t>{256, 512}));
  EXPECT_EQ(cfg.methods.size(), 4u);
  EXPECT_EQ(cfg.thresholds.out.cos, 0.98);
  EXPECT_EQ(cfg.thresholds.out.sqnr_db, 8.0);
  EXPECT_EQ(cfg.thresholds.dq.sqnr_db, 10.0);
  EXPECT_EQ(cfg.thresholds.dk.sqnr_db, 8.0);
  EXPECT_EQ(cfg.thresholds.dv.cos, 0.97);
  const auto d = selected_dists(cfg);
  EXPECT_EQ(d.size(), 8u);  // all but long
  EXPECT_EQ(std::count(d.begin(), d.end(), Dist::kLong), 0);
  cfg.long_ctx = true;
  EXPECT_EQ(selected_dists(cfg).size(), 9u);
}

TEST(AccuracyArgs, EveryFlag) {
  Config cfg;
  bool help = false;
  ASSERT_TRUE(parse({"--dist", "normal,sink", "--lengths=0,5,70", "--heads", "3", "--lq", "64", "--broadcast-q",
                     "--seed", "9", "--methods", "mx,gpu", "--thresholds", "out=0.9:5,dk=0.8:4,lse=0.2",
                     "--borderline", "2:0.01", "--softmax-scale", "0.5", "--json", "x.json", "--quick", "--long",
                     "--threads", "1"},
                    &cfg, &help)
                  .ok());
  EXPECT_FALSE(help);
  EXPECT_EQ(cfg.dists, (std::vector<Dist>{Dist::kNormal, Dist::kSink}));
  EXPECT_EQ(cfg.lengths, (std::vector<int64_t>{0, 5, 70}));
  EXPECT_EQ(cfg.heads, 3);
  EXPECT_EQ(cfg.lq, 64);
  EXPECT_TRUE(cfg.broadcast_q);
  EXPECT_EQ(cfg.seed, 9u);
  EXPECT_EQ(cfg.methods, (std::vector<Method>{Method::kMx, Method::kGpu}));
  EXPECT_EQ(cfg.thresholds.out.cos, 0.9);
  EXPECT_EQ(cfg.thresholds.out.sqnr_db, 5.0);
  EXPECT_EQ(cfg.thresholds.dk.cos, 0.8);
  EXPECT_EQ(cfg.thresholds.dq.sqnr_db, 10.0);  // untouched
  EXPECT_EQ(cfg.thresholds.lse_max_rel, 0.2);
  EXPECT_EQ(cfg.thresholds.border_db, 2.0);
  EXPECT_EQ(cfg.thresholds.border_cos, 0.01);
  EXPECT_EQ(cfg.softmax_scale, 0.5);
  EXPECT_EQ(cfg.json_path, "x.json");
  EXPECT_TRUE(cfg.quick);
  EXPECT_TRUE(cfg.long_ctx);
  EXPECT_EQ(cfg.threads, 1);
  Config all;
  ASSERT_TRUE(parse({"--dist", "all"}, &all).ok());
  EXPECT_EQ(all.dists.size(), 9u);
  Config h;
  ASSERT_TRUE(parse({"-h"}, &h, &help).ok());
  EXPECT_TRUE(help);
}

TEST(AccuracyArgs, RejectsBadArguments) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"--dist", "normal,foo"}, "--dist"},       {{"--lengths", "3,-1"}, "--lengths"},
      {{"--lengths", "3,x"}, "--lengths"},        {{"--heads", "0"}, "--heads"},
      {{"--heads"}, "needs a value"},             {{"--lq", "1.5"}, "--lq"},
      {{"--broadcast-q"}, "--lq"},                {{"--methods", "mx,int4"}, "--methods"},
      {{"--thresholds", "out=0.9"}, "COS:SQNR"},  {{"--thresholds", "o=0.9:3"}, "--thresholds"},
      {{"--borderline", "1"}, "--borderline"},    {{"--softmax-scale", "-1"}, "--softmax-scale"},
      {{"--quick=1"}, "takes no value"},          {{"--frobnicate"}, "unknown argument"},
      {{"--seed", "-3"}, "--seed"},               {{"--threads", "0"}, "--threads"}};
  for (const auto& [args, needle] : bad) {
    Config cfg;
    const Status s = parse(args, &cfg);
    EXPECT_FALSE(s.ok()) << args[0];
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  }
}

TEST(AccuracyShapes, SuiteShapes) {
  Config cfg;
  EXPECT_EQ(shape_for(Dist::kJagged, cfg).k_lengths,
            (std::vector<int64_t>{0, 1, 31, 32, 33, 127, 128, 129, 1000, 4096}));
  cfg.quick = true;
  const Shape j = shape_for(Dist::kJagged, cfg);
  EXPECT_EQ(j.k_lengths, (std::vector<int64_t>{0, 1, 31, 32, 33, 127, 128, 129, 1000}));
  EXPECT_EQ(j.q_lengths, j.k_lengths);
  const Shape l = shape_for(Dist::kLong, cfg);
  EXPECT_EQ(l.k_lengths, (std::vector<int64_t>{kLongKeys}));
  EXPECT_EQ(l.q_lengths, (std::vector<int64_t>{kLongQueriesDefault}));
  EXPECT_GE(kLongKeys, 16384);
  cfg.lq = 48;
  EXPECT_EQ(shape_for(Dist::kNormal, cfg).q_lengths, (std::vector<int64_t>{48, 48}));
  cfg.broadcast_q = true;
  const Shape b = shape_for(Dist::kSink, cfg);
  EXPECT_TRUE(b.broadcast_q);
  EXPECT_EQ(b.q_lengths, (std::vector<int64_t>{48}));
  EXPECT_EQ(b.k_lengths, cfg.lengths);
}

double rms(const std::vector<float>& x, size_t begin, size_t end, size_t stride) {
  double s = 0;
  size_t n = 0;
  for (size_t i = begin; i < end; i += stride, ++n) s += double(x[i]) * x[i];
  return std::sqrt(s / double(n));
}

TEST(AccuracyInputs, DistributionsDoWhatTheySay) {
  const Shape sh{{64, 32}, {64, 32}, false};
  Inputs base, again, other;
  ASSERT_TRUE(make_inputs(Dist::kNormal, sh, 2, 1, &base).ok());
  ASSERT_TRUE(make_inputs(Dist::kNormal, sh, 2, 1, &again).ok());
  ASSERT_TRUE(make_inputs(Dist::kNormal, sh, 2, 2, &other).ok());
  EXPECT_EQ(base.q, again.q);  // deterministic in the seed
  EXPECT_NE(base.q, other.q);
  EXPECT_EQ(base.q.size(), size_t(96 * 2 * 128));
  EXPECT_EQ(base.dout.size(), base.q.size());
  EXPECT_NEAR(rms(base.k, 0, base.k.size(), 1), 1.0, 0.05);

  Inputs tiny, peaked, sink, kout;
  ASSERT_TRUE(make_inputs(Dist::kTiny, sh, 2, 1, &tiny).ok());
  EXPECT_NEAR(rms(tiny.v, 0, tiny.v.size(), 1), 1e-3, 1e-4);
  EXPECT_NEAR(rms(tiny.dout, 0, tiny.dout.size(), 1), 1e-3, 1e-4);
  ASSERT_TRUE(make_inputs(Dist::kPeaked, sh, 2, 1, &peaked).ok());
  EXPECT_NEAR(rms(peaked.q, 0, peaked.q.size(), 1), 8.0, 0.4);
  EXPECT_NEAR(rms(peaked.k, 0, peaked.k.size(), 1), 1.0, 0.05);
  ASSERT_TRUE(make_inputs(Dist::kSink, sh, 2, 1, &sink).ok());
  const size_t row = 2 * 128;  // one token, both heads
  EXPECT_GT(rms(sink.k, 0, row, 1), 20.0);            // first key of sequence 0
  EXPECT_GT(rms(sink.k, 64 * row, 65 * row, 1), 20.0); // first key of sequence 1
  EXPECT_LT(rms(sink.k, row, 64 * row, 1), 1.2);
  ASSERT_TRUE(make_inputs(Dist::kKOutlier, sh, 2, 1, &kout).ok());
  int big = 0;
  for (int c = 0; c < 128; ++c) big += rms(kout.k, size_t(c), kout.k.size(), 128) > 5.0;
  EXPECT_EQ(big, 4);
  Inputs heavy;
  ASSERT_TRUE(make_inputs(Dist::kHeavyTail, sh, 2, 1, &heavy).ok());
  float amax = 0;
  for (float x : heavy.q) amax = std::max(amax, std::fabs(x));
  EXPECT_GT(amax, 10.f);  // Student-t(3) tails; a normal sample of this size stays below ~5
  Inputs bad;
  EXPECT_FALSE(make_inputs(Dist::kNormal, Shape{{4}, {4, 4}, false}, 1, 1, &bad).ok());
}

// A tiny suite run through the CLI entry point: passes, reports the reserved gpu column, writes JSON.
TEST(AccuracyCli, EndToEndTinyRunPasses) {
  const std::string json = ::testing::TempDir() + "mxflash_accuracy_test.json";
  std::ostringstream out, err;
  const int rc = run_cli({"--dist", "normal,jagged", "--lengths", "40,33", "--heads", "1", "--quick", "--lq", "37",
                          "--threads", "2", "--json", json},
                         out, err);
  EXPECT_EQ(rc, 0) << out.str() << err.str();
  const std::string text = out.str();
  EXPECT_NE(text.find("summary: 8 pass / 0 borderline / 0 fail"), std::string::npos) << text;
  EXPECT_NE(text.find(kGpuNotBuilt), std::string::npos);
  EXPECT_NE(text.find("jagged: K/V lengths [0,1,31,32,33,127,128,129,1000], Q lengths [37"), std::string::npos)
      << text;
  std::ifstream f(json);
  std::stringstream js;
  js << f.rdbuf();
  const std::string j = js.str();
  for (const char* key : {"\"tool\"", "\"config\"", "\"thresholds\"", "\"shapes\"", "\"results\"", "\"summary\"",
                          "\"sqnr_db\"", "\"cosine\"", "\"max_rel_err\"", "\"verdict\"", "\"dist\": \"jagged\"",
                          "\"method\": \"gpu\"", "\"status\": \"n/a (not built yet)\"", "\"tensor\": \"lse\"",
                          "\"pass\": 8", "\"fail\": 0", "\"borderline_db\""})
    EXPECT_NE(j.find(key), std::string::npos) << key;
  EXPECT_EQ(std::count(j.begin(), j.end(), '{'), std::count(j.begin(), j.end(), '}'));
  std::remove(json.c_str());
}

// --forward-only: O and LSE judged, the gradients reported as not computed (no backward run).
TEST(AccuracyCli, ForwardOnlySkipsTheBackward) {
  std::ostringstream out, err;
  const int rc = run_cli({"--dist", "normal", "--lengths", "40", "--heads", "1", "--methods", "mx", "--forward-only",
                          "--threads", "2"},
                         out, err);
  EXPECT_EQ(rc, 0) << out.str() << err.str();
  const std::string text = out.str();
  EXPECT_NE(text.find("summary: 1 pass / 0 borderline / 0 fail"), std::string::npos) << text;
  EXPECT_NE(text.find(std::string("dQ      ") + kForwardOnly), std::string::npos) << text;
  Config cfg;
  bool help = false;
  ASSERT_TRUE(parse_args({"--forward-only"}, &cfg, &help).ok());
  EXPECT_TRUE(cfg.forward_only);
  EXPECT_FALSE(parse_args({"--forward-only", "x"}, &cfg, &help).ok());
}

TEST(AccuracyCli, FailingFloorGivesExitOneAndBadArgsTwo) {
  std::ostringstream out, err;
  EXPECT_EQ(run_cli({"--dist", "normal", "--lengths", "32", "--heads", "1", "--methods", "mx", "--thresholds",
                     "out=0.98:40"},
                    out, err),
            1);
  EXPECT_NE(out.str().find("summary: 3 pass / 0 borderline / 1 fail"), std::string::npos) << out.str();
  std::ostringstream o2, e2;
  EXPECT_EQ(run_cli({"--heads", "-1"}, o2, e2), 2);
  EXPECT_NE(e2.str().find("--heads"), std::string::npos);
  std::ostringstream o3, e3;
  EXPECT_EQ(run_cli({"--help"}, o3, e3), 0);
  EXPECT_NE(o3.str().find("usage: mxflash-accuracy"), std::string::npos);
}

}  // namespace
}  // namespace mxflash::accuracy

namespace mxflash::accuracy {
namespace {

// The gpu column through the GpuForward hook: forward tensors judged like mx, the backward reported
// as not built, and a failing hook stops the run with its message.
TEST(AccuracyGpuHook, FillsForwardColumnAndReportsMissingBackward) {
  Config cfg;
  cfg.dists = {Dist::kNormal};
  cfg.lengths = {40};
  cfg.heads = 1;
  cfg.threads = 2;
  cfg.methods = {Method::kMx, Method::kGpu};
  int calls = 0;
  // A stand-in "GPU" that is the exact-MX reference itself: its numbers must equal the mx column.
  cfg.gpu_forward = [&](const Inputs& in, std::vector<double>* out, std::vector<double>* lse) {
    ++calls;
    ref::AttnForwardResult r;
    MXFLASH_RETURN_IF_ERROR(ref::attention_forward(in.problem(), ref::AttnMethod::kMx, &r));
    *out = r.out;
    *lse = r.lse;
    return Status::Ok();
  };
  std::vector<Record> records;
  ASSERT_TRUE(run_suite(cfg, &records, nullptr).ok());
  EXPECT_EQ(calls, 1);
  const Record* mx_out = nullptr;
  for (const Record& r : records) {
    if (r.method == Method::kMx && r.tensor == Tensor::kOut) mx_out = &r;
  }
  ASSERT_NE(mx_out, nullptr);
  for (const Record& r : records) {
    if (r.method != Method::kGpu) continue;
    const bool fwd = r.tensor == Tensor::kOut || r.tensor == Tensor::kLse;
    EXPECT_EQ(r.available, fwd) << to_string(r.tensor);
    if (!fwd) EXPECT_STREQ(r.missing, kGpuBackwardNotBuilt);
    if (r.tensor == Tensor::kOut) {
      EXPECT_DOUBLE_EQ(r.stats.sqnr_db, mx_out->stats.sqnr_db);
      EXPECT_EQ(r.verdict, Verdict::kPass);
    }
  }
  // --gpu-within-db: a "GPU" whose O is off by +-10% (about 19 dB SQNR: above the floors, far
  // under mx's ~25 dB) fails at 0.3 dB and passes the floors without the option.
  cfg.gpu_within_db = 0.3;
  cfg.gpu_forward = [&](const Inputs& in, std::vector<double>* out, std::vector<double>* lse) {
    ref::AttnForwardResult r;
    MXFLASH_RETURN_IF_ERROR(ref::attention_forward(in.problem(), ref::AttnMethod::kMx, &r));
    for (size_t i = 0; i < r.out.size(); ++i) r.out[i] *= 1.0 + (i % 2 ? 0.1 : -0.1);  // far worse than mx
    *out = r.out;
    *lse = r.lse;
    return Status::Ok();
  };
  records.clear();
  ASSERT_TRUE(run_suite(cfg, &records, nullptr).ok());
  for (const Record& r : records)
    if (r.method == Method::kGpu && r.tensor == Tensor::kOut) EXPECT_EQ(r.verdict, Verdict::kFail);
  cfg.gpu_within_db = 0.0;
  records.clear();
  ASSERT_TRUE(run_suite(cfg, &records, nullptr).ok());
  for (const Record& r : records)
    if (r.method == Method::kGpu && r.tensor == Tensor::kOut) EXPECT_NE(r.verdict, Verdict::kFail);  // floors only
  cfg.gpu_forward = [](const Inputs&, std::vector<double>*, std::vector<double>*) {
    return Status::Cuda("device lost");
  };
  records.clear();
  const Status st = run_suite(cfg, &records, nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("device lost"), std::string::npos);
}

}  // namespace
}  // namespace mxflash::accuracy
