// mxflash-bench command line: presets expand to the documented shapes, flags override them, and
// bad input fails with a message naming the flag.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "bench_options.h"

namespace mxflash::bench {
namespace {

ParseResult parse(std::vector<std::string> args, Options* opt) {
  args.insert(args.begin(), "mxflash-bench");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  return parse_args(int(argv.size()), argv.data(), opt);
}

void expect_error(std::vector<std::string> args, const std::string& must_mention) {
  Options opt;
  const ParseResult r = parse(args, &opt);
  EXPECT_FALSE(r.ok) << "accepted: " << (args.empty() ? "" : args[0]);
  EXPECT_NE(r.error.find(must_mention), std::string::npos) << "error '" << r.error << "' should mention '"
                                                            << must_mention << "'";
}

TEST(BenchOptions, DefaultIsAllPresetsBothDirections) {
  Options opt;
  ASSERT_TRUE(parse({}, &opt).ok);
  ASSERT_EQ(opt.cases.size(), 4u);
  EXPECT_EQ(opt.cases[0].name, "llm");
  EXPECT_EQ(opt.cases[1].name, "llm-long");
  EXPECT_EQ(opt.cases[2].name, "cross");
  EXPECT_EQ(opt.cases[3].name, "jagged");
  EXPECT_TRUE(opt.run_fwd);
  EXPECT_TRUE(opt.run_bwd);
  EXPECT_FALSE(opt.run_quantize);
  EXPECT_EQ(opt.impls, (std::vector<std::string>{"cudnn-bf16", "cudnn-fp8", "mxfp8", "mxfp8-exec"}));
  EXPECT_DOUBLE_EQ(opt.warmup_s, 1.0);
  EXPECT_DOUBLE_EQ(opt.window_s, 5.0);
  EXPECT_EQ(opt.launches, 5);
}

TEST(BenchOptions, PresetsExpandToTheDocumentedShapes) {
  Options opt;
  ASSERT_TRUE(parse({"--preset", "all"}, &opt).ok);
  ASSERT_EQ(opt.cases.size(), 4u);
  CaseLengths l;
  std::string err;

  const CaseSpec& llm = opt.cases[0];
  ASSERT_TRUE(realize_lengths(llm, &l, &err)) << err;
  EXPECT_EQ(llm.heads, 16);
  EXPECT_FALSE(llm.broadcast_q);
  EXPECT_EQ(l.lq, std::vector<int64_t>(8, 2048));
  EXPECT_EQ(l.lk, std::vector<int64_t>(8, 2048));

  const CaseSpec& lng = opt.cases[1];
  ASSERT_TRUE(realize_lengths(lng, &l, &err)) << err;
  EXPECT_EQ(lng.heads, 16);
  EXPECT_EQ(l.lq, std::vector<int64_t>(2, 8192));
  EXPECT_EQ(l.lk, std::vector<int64_t>(2, 8192));

  const CaseSpec& cross = opt.cases[2];
  ASSERT_TRUE(realize_lengths(cross, &l, &err)) << err;
  EXPECT_EQ(cross.heads, 3);
  EXPECT_TRUE(cross.broadcast_q);
  EXPECT_EQ(l.lq, std::vector<int64_t>(64, 512));
  EXPECT_EQ(l.lk, std::vector<int64_t>(64, 16384));

  const CaseSpec& jag = opt.cases[3];
  ASSERT_TRUE(realize_lengths(jag, &l, &err)) << err;
  EXPECT_EQ(jag.heads, 3);
  EXPECT_TRUE(jag.broadcast_q);
  EXPECT_EQ(l.lq, std::vector<int64_t>(768, 512));
  ASSERT_EQ(l.lk.size(), 768u);
  EXPECT_EQ(jag.lk.kind, LengthSpec::Kind::kJagged);
  EXPECT_DOUBLE_EQ(jag.lk.fill, 0.5);
  EXPECT_EQ(jag.lk.max, 16384);
  int64_t sum = 0;
  for (int64_t x : l.lk) {
    EXPECT_GE(x, 0);
    EXPECT_LE(x, 16384);
    sum += x;
  }
  EXPECT_NEAR(double(sum) / (768.0 * 16384.0), 0.5, 0.01);
}

TEST(BenchOptions, PresetListKeepsCanonicalOrder) {
  Options opt;
  ASSERT_TRUE(parse({"--preset=jagged,llm"}, &opt).ok);
  ASSERT_EQ(opt.cases.size(), 2u);
  EXPECT_EQ(opt.cases[0].name, "llm");
  EXPECT_EQ(opt.cases[1].name, "jagged");
}

TEST(BenchOptions, FlagsOverridePresetsAndMarkThem) {
  Options opt;
  ASSERT_TRUE(parse({"--preset", "jagged", "--batch", "16", "--heads", "2"}, &opt).ok);
  ASSERT_EQ(opt.cases.size(), 1u);
  EXPECT_EQ(opt.cases[0].name, "jagged*");
  EXPECT_EQ(opt.cases[0].batch, 16);
  EXPECT_EQ(opt.cases[0].heads, 2);
  EXPECT_TRUE(opt.cases[0].broadcast_q);
}

TEST(BenchOptions, CustomShapeListAndJagged) {
  Options opt;
  ASSERT_TRUE(parse({"--lq", "17,0,129", "--heads", "4", "--workload", "fwd"}, &opt).ok);
  ASSERT_EQ(opt.cases.size(), 1u);
  EXPECT_EQ(opt.cases[0].name, "custom");
  EXPECT_TRUE(opt.run_fwd);
  EXPECT_FALSE(opt.run_bwd);
  CaseLengths l;
  std::string err;
  ASSERT_TRUE(realize_lengths(opt.cases[0], &l, &err)) << err;
  EXPECT_EQ(l.lq, (std::vector<int64_t>{17, 0, 129}));
  EXPECT_EQ(l.lk, l.lq);  // --lk defaults to "same"

  ASSERT_TRUE(parse({"--batch", "32", "--lq", "jagged:0.25:4096", "--lk", "2048"}, &opt).ok);
  ASSERT_TRUE(realize_lengths(opt.cases[0], &l, &err)) << err;
  EXPECT_EQ(l.lq.size(), 32u);
  EXPECT_EQ(l.lk, std::vector<int64_t>(32, 2048));
}

TEST(BenchOptions, Workloads) {
  Options opt;
  ASSERT_TRUE(parse({"--workload", "quantize"}, &opt).ok);
  EXPECT_TRUE(opt.run_quantize);
  EXPECT_FALSE(opt.run_fwd);
  EXPECT_FALSE(opt.run_bwd);
  EXPECT_TRUE(opt.cases.empty());
  ASSERT_TRUE(parse({"--workload", "all", "--preset", "llm"}, &opt).ok);
  EXPECT_TRUE(opt.run_quantize && opt.run_fwd && opt.run_bwd);
  ASSERT_TRUE(parse({"--workload", "bwd", "--impl", "cudnn-fp8,cudnn-bf16"}, &opt).ok);
  EXPECT_FALSE(opt.run_fwd);
  EXPECT_TRUE(opt.run_bwd);
  EXPECT_EQ(opt.impls, (std::vector<std::string>{"cudnn-bf16", "cudnn-fp8"}));
}

TEST(BenchOptions, CommandLineIsRecordedQuoted) {
  Options opt;
  ASSERT_TRUE(parse({"--preset", "llm", "--json", "out dir/r.json"}, &opt).ok);
  EXPECT_EQ(opt.command_line, "mxflash-bench --preset llm --json 'out dir/r.json'");
  EXPECT_EQ(shell_quote("it's"), "'it'\\''s'");
}

TEST(BenchOptions, CausalFlag) {
  Options opt;
  ASSERT_TRUE(parse({}, &opt).ok);
  for (const CaseSpec& c : opt.cases) EXPECT_EQ(c.causal, CausalMask::kNone);
  // bare --causal: top_left on every preset, which it changes ("*")
  ASSERT_TRUE(parse({"--causal"}, &opt).ok);
  ASSERT_EQ(opt.cases.size(), 4u);
  for (const CaseSpec& c : opt.cases) {
    EXPECT_EQ(c.causal, CausalMask::kTopLeft);
    EXPECT_EQ(c.name.back(), '*');
  }
  ASSERT_TRUE(parse({"--preset", "llm", "--causal", "bottom_right", "--workload", "fwd"}, &opt).ok);
  ASSERT_EQ(opt.cases.size(), 1u);
  EXPECT_EQ(opt.cases[0].causal, CausalMask::kBottomRight);
  EXPECT_EQ(opt.cases[0].name, "llm*");
  EXPECT_FALSE(opt.run_bwd);
  ASSERT_TRUE(parse({"--causal=top-left", "--preset", "cross"}, &opt).ok);
  EXPECT_EQ(opt.cases.at(0).causal, CausalMask::kTopLeft);
  ASSERT_TRUE(parse({"--preset", "jagged", "--causal", "--check"}, &opt).ok);  // a flag after a bare --causal
  EXPECT_EQ(opt.cases.at(0).causal, CausalMask::kTopLeft);
  EXPECT_TRUE(opt.check);
  ASSERT_TRUE(parse({"--lq", "17,0,129", "--lk", "5,3,200", "--causal", "bottom-right"}, &opt).ok);
  EXPECT_EQ(opt.cases.at(0).name, "custom");
  EXPECT_EQ(opt.cases.at(0).causal, CausalMask::kBottomRight);
  // --causal none: the presets unchanged
  ASSERT_TRUE(parse({"--preset", "llm", "--causal", "none"}, &opt).ok);
  EXPECT_EQ(opt.cases.at(0).name, "llm");
  EXPECT_EQ(opt.cases.at(0).causal, CausalMask::kNone);
  EXPECT_STREQ(causal_name(CausalMask::kTopLeft), "top_left");
  EXPECT_STREQ(causal_name(CausalMask::kBottomRight), "bottom_right");
  expect_error({"--causal", "diagonal"}, "--causal");
  expect_error({"--causal=yes"}, "--causal");
  expect_error({"--causal="}, "--causal");
  expect_error({"--workload", "quantize", "--causal"}, "--causal");
}

TEST(BenchOptions, BadInputNamesTheFlag) {
  expect_error({"--bogus"}, "--bogus");
  expect_error({"--preset", "huge"}, "--preset");
  expect_error({"--preset", "huge"}, "huge");
  expect_error({"--impl", "flash3"}, "--impl");
  expect_error({"--batch", "abc"}, "--batch");
  expect_error({"--batch", "0"}, "--batch");
  expect_error({"--batch", "-3"}, "--batch");
  expect_error({"--batch", "12x"}, "--batch");
  expect_error({"--heads", "1.5"}, "--heads");
  expect_error({"--warmup-s", "-1"}, "--warmup-s");
  expect_error({"--window-s", "nan"}, "--window-s");
  expect_error({"--window-s", "0"}, "--window-s");
  expect_error({"--launches", "0"}, "--launches");
  expect_error({"--lq", "jagged:2:100"}, "--lq");
  expect_error({"--lq", "jagged:0.5"}, "--lq");
  expect_error({"--lq", "1,x,3"}, "--lq");
  expect_error({"--lq", "same"}, "--lq");
  expect_error({"--preset", "llm", "--lq", "1,2,3"}, "--lq");  // list of 3 vs batch 8
  expect_error({"--preset", "cross", "--lq", "jagged:0.5:512"}, "broadcast");
  expect_error({"--workload", "sideways"}, "--workload");
  expect_error({"--cudnn-layout", "thd"}, "--cudnn-layout");
  expect_error({"--quant-orient", "diag"}, "--quant-orient");
  expect_error({"--json"}, "--json");
  expect_error({"--check=yes"}, "--check");
  expect_error({"--heads", "4"}, "--lq");  // custom shape without lengths
  expect_error({"--workload", "quantize", "--preset", "llm"}, "--workload");
}

TEST(BenchOptions, QuantizeLengthsAreSizedToTheRequestedBytes) {
  Options opt;
  ASSERT_TRUE(parse({"--workload", "quantize"}, &opt).ok);
  std::vector<int64_t> len;
  std::string err;
  ASSERT_TRUE(quantize_lengths(opt, &len, &err)) << err;
  int64_t total = 0;
  for (int64_t x : len) total += x;
  const double bytes = double(total) * 3 * 128 * 2;
  EXPECT_NEAR(bytes / 1073741824.0, 1.0, 0.02);
  ASSERT_TRUE(parse({"--workload", "quantize", "--quant-lengths", "4096", "--quant-gib", "0.5", "--quant-heads", "16"},
                    &opt)
                  .ok);
  ASSERT_TRUE(quantize_lengths(opt, &len, &err)) << err;
  EXPECT_EQ(len, std::vector<int64_t>(32, 4096));  // 32 * 4096 * 16 * 128 * 2 bytes = 0.5 GiB
}

}  // namespace
}  // namespace mxflash::bench
