// mxflash-bench: one honest benchmark binary (STYLE.md §6). Attention forward/backward of cuDNN
// BF16, cuDNN FP8 and ours side by side, and our MX quantizer next to a device copy; protocol of
// REFERENCE.md §6; table printed last, JSON with raw samples on request.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>

#include "bench_cuda.h"
#include "bench_env.h"
#include "bench_harness.h"
#include "bench_impl.h"
#include "bench_options.h"
#include "bench_quantize.h"
#include "bench_report.h"

namespace mxflash::bench {
namespace {

constexpr double kCheckMinCosine = 0.99;  // a loose bound: catches a broken graph, not FP8 error

struct Prepared {
  std::string name;
  std::unique_ptr<AttnImpl> impl;  // null when unavailable or its preparation failed
  std::string status, message;     // why not, when impl is null
  int n_sets = 1;
};

ImplResult failed_result(const std::string& impl, Direction d, const std::string& status, const std::string& msg) {
  ImplResult r;
  r.impl = impl;
  r.direction = to_string(d);
  r.status = status;
  r.message = msg;
  r.unit = "TFLOP/s";
  return r;
}

std::string gb(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f GB", bytes / 1e9);
  return b;
}

// Leading query rows of each sequence that attend no key (out 0 and dQ 0 in ours; a peer may leave
// them undefined): all Lq rows when Lk = 0, and under bottom_right the rows i < Lq - Lk.
std::vector<int32_t> rows_without_keys(const AttnProblem& p) {
  std::vector<int32_t> skip(p.lq.size(), 0);
  for (size_t b = 0; b < p.lq.size() && b < p.lk.size(); ++b) {
    int64_t i = 0;
    while (i < p.lq[b] && causal_keys(p.causal, i, p.lq[b], p.lk[b]) == 0) ++i;  // a prefix of the rows
    skip[b] = int32_t(i);
  }
  return skip;
}

// --check: every impl against the first one prepared (cuDNN BF16 when present), outside timing, with
// the problem's causal mask in every impl. O and dQ are compared on the query rows that attend a key.
bool run_check(const AttnProblem& problem, std::vector<Prepared>& impls, const std::vector<Direction>& dirs,
               cudaStream_t s,
               std::map<std::pair<std::string, std::string>, std::vector<std::pair<std::string, double>>>* out) {
  Prepared* ref = nullptr;
  for (Prepared& p : impls)
    if (p.impl) {
      ref = &p;
      break;
    }
  if (!ref) return true;
  bool pass = true;
  DeviceBuffer acc, skip;
  if (!acc.alloc(4 * sizeof(double)).ok() || !skip.upload(rows_without_keys(problem)).ok()) return false;
  for (Direction d : dirs) {
    const std::vector<std::string> names =
        d == Direction::kFwd ? std::vector<std::string>{"O"} : std::vector<std::string>{"dQ", "dK", "dV"};
    if (!ref->impl->run(d, 0, s).ok()) continue;
    for (Prepared& p : impls) {
      if (!p.impl || &p == ref) continue;
      Status st = p.impl->run(d, 0, s);
      if (st.code() == StatusCode::kUnsupported) {
        std::fprintf(stderr, "[mxflash-bench] check %s %s: not checked (%s)\n", to_string(d), p.name.c_str(),
                     st.message().c_str());
        continue;
      }
      for (const std::string& n : names) {
        OutputView a, b;
        if (st.ok()) st = ref->impl->output(d, n, &a);
        if (st.ok()) st = p.impl->output(d, n, &b);
        if (st.code() == StatusCode::kUnsupported) {  // e.g. a dQ summed over the batch (broadcast_q)
          std::fprintf(stderr, "[mxflash-bench] check %s %s %s: not checked (%s)\n", to_string(d), p.name.c_str(),
                       n.c_str(), st.message().c_str());
          st = Status::Ok();
          continue;
        }
        double h[4] = {0, 0, 0, 0};
        const int32_t* skip_rows = (n == "O" || n == "dQ") ? skip.as<int32_t>() : nullptr;
        if (st.ok()) st = compare(a.data, a.elem, a.scale, *a.layout, b.data, b.elem, b.scale, *b.layout,
                                  acc.as<double>(), s, skip_rows);
        if (st.ok()) st = cuda_status(cudaMemcpyAsync(h, acc.get(), sizeof h, cudaMemcpyDeviceToHost, s), "copy");
        if (st.ok()) st = cuda_status(cudaStreamSynchronize(s), "check");
        if (!st.ok()) {
          std::fprintf(stderr, "[mxflash-bench] check %s %s vs %s: %s\n", to_string(d), p.name.c_str(),
                       ref->name.c_str(), st.message().c_str());
          cudaGetLastError();
          pass = false;
          break;
        }
        const double cos = h[0] / std::sqrt(std::max(h[1] * h[2], 1e-300));
        const double rel = std::sqrt(h[3] / std::max(h[1], 1e-300));
        const bool ok = std::isfinite(cos) && cos > kCheckMinCosine;
        pass &= ok;
        auto& v = (*out)[{p.name, to_string(d)}];
        v.push_back({"cos_" + n + "_vs_" + ref->name, cos});
        v.push_back({"rel_l2_" + n + "_vs_" + ref->name, rel});
        std::fprintf(stderr, "[mxflash-bench] check %s %s vs %s: %s cos %.6f rel-l2 %.4f  %s\n", to_string(d),
                     p.name.c_str(), ref->name.c_str(), n.c_str(), cos, rel, ok ? "PASS" : "FAIL");
      }
    }
  }
  return pass;
}

int run(const Options& opt) {
  if (cudaSetDevice(opt.device) != cudaSuccess) {
    std::fprintf(stderr, "mxflash-bench: error: --device: cannot use CUDA device %d: %s\n", opt.device,
                 cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  BenchReport rep;
  rep.command = opt.command_line;
  rep.env = collect_env(opt.device);
  rep.warmup_s = opt.warmup_s;
  rep.window_s = opt.window_s;
  rep.launches = opt.launches;
  rep.check = opt.check;
  rep.cudnn_layout = opt.cudnn_layout;
  rep.notes.push_back({"data", "inputs normal(0,1) from a counter-based hash on the GPU (seeded), never zeros"});
  {
    // The causal masks of the cases (--causal applies one to all of them).
    std::vector<std::string> masks;
    for (const CaseSpec& c : opt.cases)
      if (std::find(masks.begin(), masks.end(), causal_name(c.causal)) == masks.end())
        masks.push_back(causal_name(c.causal));
    std::string mask = masks.empty() || (masks.size() == 1 && masks[0] == std::string("none"))
                           ? "non-causal"
                           : "causal mask ";
    if (mask != "non-causal")
      for (size_t i = 0; i < masks.size(); ++i) mask += (i ? ", " : "") + masks[i];
    rep.notes.push_back({"softmax", mask + ", softmax scale 1/sqrt(128), head dim 128"});
    if (mask != "non-causal")
      rep.notes.push_back({"causal", "row i of a Q sequence of Lq rows attends keys j < n(i) of its K/V sequence of Lk "
                                     "keys: top_left n(i) = min(i + 1, Lk), bottom_right n(i) = clamp(i + 1 + Lk - Lq, "
                                     "0, Lk) (mxflash::causal_keys); FLOPs count sum_i n(i) pairs, not Lq*Lk; every "
                                     "impl applies the mask or is reported unsupported"});
  }
  const EnvInfo& e = rep.env;
  std::fprintf(stderr, "[mxflash-bench] %s (sm_%d%d, %d SMs, L2 %.1f MB, %.1f GB), CUDA runtime %d, driver %d, "
                       "cuDNN %lld (built with %lld, frontend %s)\n",
               e.gpu_name.c_str(), e.cc_major, e.cc_minor, e.sm_count, e.l2_bytes / 1e6, e.memory_bytes / 1e9,
               e.runtime_version, e.driver_version, (long long)e.cudnn_runtime_version,
               (long long)e.cudnn_compiled_version, e.cudnn_frontend_version.c_str());
  if (e.cudnn_runtime_version && e.cudnn_runtime_version / 100 != e.cudnn_compiled_version / 100)
    std::fprintf(stderr, "[mxflash-bench] note: cuDNN at run time (%lld) differs from the headers (%lld)\n",
                 (long long)e.cudnn_runtime_version, (long long)e.cudnn_compiled_version);

  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    std::fprintf(stderr, "mxflash-bench: error: cudaStreamCreate failed\n");
    return 1;
  }
  const Protocol proto{opt.warmup_s, opt.window_s, opt.launches};
  std::vector<Direction> dirs;
  if (opt.run_fwd) dirs.push_back(Direction::kFwd);
  if (opt.run_bwd) dirs.push_back(Direction::kBwd);
  bool check_pass = true;
  int measured = 0;

  for (const CaseSpec& spec : opt.cases) {
    CaseLengths l;
    std::string err;
    realize_lengths(spec, &l, &err);  // validated while parsing
    AttnProblem p;
    p.name = spec.name;
    p.batch = int(l.lk.size());
    p.heads = int(spec.heads);
    p.head_dim = int(spec.head_dim);
    p.broadcast_q = spec.broadcast_q;
    p.causal = spec.causal;
    p.lq = l.lq;
    p.lk = l.lk;
    p.seed = spec.seed;
    p.softmax_scale = float(1.0 / std::sqrt(double(spec.head_dim)));
    p.need_fwd = true;  // the backward needs the forward's O and LSE
    p.need_bwd = opt.run_bwd;
    p.cudnn_layout = opt.cudnn_layout;

    CaseReport cr;
    cr.name = spec.name;
    cr.workload = "attention";
    cr.batch = p.batch;
    cr.heads = p.heads;
    cr.head_dim = p.head_dim;
    cr.broadcast_q = p.broadcast_q;
    cr.causal = causal_name(spec.causal);
    cr.lq_spec = spec.lq.to_string();
    cr.lk_spec = spec.lk.to_string();
    cr.seed = spec.seed;
    cr.lq = l.lq;
    cr.lk = l.lk;
    cr.flops_fwd = attention_flops(l, p.heads, p.head_dim, false, p.causal);
    cr.flops_bwd = attention_flops(l, p.heads, p.head_dim, true, p.causal);
    std::fprintf(stderr, "[mxflash-bench] case %s: B=%d H=%d Lq=%s%s Lk=%s (total K tokens %lld, max %lld)%s%s, "
                         "fwd %.3f TFLOP, bwd %.3f TFLOP per launch\n",
                 p.name.c_str(), p.batch, p.heads, cr.lq_spec.c_str(), p.broadcast_q ? " (broadcast)" : "",
                 cr.lk_spec.c_str(), (long long)p.total_k(), (long long)p.max_lk(),
                 p.causal == CausalMask::kNone ? "" : ", causal ", p.causal == CausalMask::kNone ? "" : cr.causal.c_str(),
                 cr.flops_fwd / 1e12, cr.flops_bwd / 1e12);

    std::vector<Prepared> impls;
    for (const std::string& name : opt.impls) {
      Prepared pr;
      pr.name = name;
      std::string why;
      if (name == "mxfp8" || name == "mxfp8-exec") {
        pr.impl = make_mxfp8_attention(p, name == "mxfp8-exec", &why);
      } else {
        pr.impl = make_cudnn_attention(p, name == "cudnn-fp8", &why);
      }
      if (!pr.impl) {
        pr.status = "unsupported";
        pr.message = why;
        std::fprintf(stderr, "[mxflash-bench] %s %s: %s\n", p.name.c_str(), name.c_str(), why.c_str());
      } else {
        const int64_t set_bytes = pr.impl->input_set_bytes(Direction::kFwd);
        pr.n_sets = input_sets_for(set_bytes, e.l2_bytes);
        std::fprintf(stderr, "[mxflash-bench] %s %s: preparing %d input set(s) of %s (forward inputs)\n",
                     p.name.c_str(), name.c_str(), pr.n_sets, gb(double(set_bytes)).c_str());
        const Status st = pr.impl->prepare(pr.n_sets, stream);
        if (!st.ok()) {
          pr.status = st.code() == StatusCode::kUnsupported ? "unsupported" : "error";
          pr.message = st.message();
          std::fprintf(stderr, "[mxflash-bench] %s %s: %s: %s\n", p.name.c_str(), name.c_str(), pr.status.c_str(),
                       pr.message.c_str());
          pr.impl.reset();
          cudaGetLastError();
        }
      }
      impls.push_back(std::move(pr));
    }

    std::map<std::pair<std::string, std::string>, std::vector<std::pair<std::string, double>>> checks;
    if (opt.check) check_pass &= run_check(p, impls, dirs, stream, &checks);

    for (Direction d : dirs) {
      for (Prepared& pr : impls) {
        if (!pr.impl) {
          cr.results.push_back(failed_result(pr.name, d, pr.status, pr.message));
          continue;
        }
        ImplResult r;
        r.impl = pr.name;
        r.direction = to_string(d);
        r.unit = "TFLOP/s";
        r.work = d == Direction::kFwd ? cr.flops_fwd : cr.flops_bwd;
        r.set_bytes = pr.impl->input_set_bytes(d);
        r.n_sets = pr.n_sets;
        r.notes = pr.impl->notes(d);
        r.check = checks[{pr.name, to_string(d)}];
        const std::string label = p.name + " " + to_string(d) + " " + pr.name;
        std::fprintf(stderr, "[mxflash-bench] %s: warm-up %.1f s + window %.1f s\n", label.c_str(), opt.warmup_s,
                     opt.window_s);
        AttnImpl* impl = pr.impl.get();
        const Status st = measure([&](int set) { return impl->run(d, set, stream); }, pr.n_sets, proto, stream,
                                  label, &r);
        if (!st.ok()) {
          r.status = st.code() == StatusCode::kUnsupported ? "unsupported" : "error";
          r.message = st.message();
          r.samples_ms.clear();
          cudaStreamSynchronize(stream);
          cudaGetLastError();
          std::fprintf(stderr, "[mxflash-bench] %s: %s: %s\n", label.c_str(), r.status.c_str(), r.message.c_str());
        } else {
          ++measured;
          r.notes.push_back({"sm_clock_mhz_end", std::to_string(nvml_sm_clock_mhz())});
          std::fprintf(stderr,
                       "[mxflash-bench] %s: median %.4f ms (min %.4f, stdev %.4f, %lld samples), %.1f TFLOP/s, "
                       "%.0f W, %.0f MHz, %.3f pJ/FLOP\n",
                       label.c_str(), r.stats.median, r.stats.min, r.stats.stdev, (long long)r.stats.n,
                       r.throughput(), r.power.watts(), r.power.sm_clock_mhz_mean, r.picojoules_per_work());
        }
        cr.results.push_back(std::move(r));
      }
    }
    rep.cases.push_back(std::move(cr));
  }

  const bool ours = std::find(opt.impls.begin(), opt.impls.end(), "mxfp8") != opt.impls.end();
  if (opt.run_quantize && !ours)
    std::fprintf(stderr, "[mxflash-bench] quantize: skipped (--impl excludes mxfp8, the quantizer under test)\n");
  if (opt.run_quantize && ours) {
    CaseReport qc;
    const Status st = run_quantize_case(opt, proto, e.l2_bytes, stream, &qc);
    if (!st.ok()) {
      std::fprintf(stderr, "[mxflash-bench] quantize: %s\n", st.message().c_str());
      ImplResult r;
      r.impl = "mxfp8";
      r.direction = "quantize";
      r.status = "error";
      r.message = st.message();
      qc.name = "quantize";
      qc.workload = "quantize";
      qc.results.push_back(r);
    }
    for (const ImplResult& r : qc.results) measured += r.ok();
    rep.cases.push_back(std::move(qc));
  }
  cudaStreamDestroy(stream);

  if (!opt.json_path.empty()) {
    std::ofstream f(opt.json_path);
    f << report_json(rep);
    if (!f) {
      std::fprintf(stderr, "mxflash-bench: error: --json: cannot write %s\n", opt.json_path.c_str());
      return 1;
    }
    std::fprintf(stderr, "[mxflash-bench] wrote %s\n", opt.json_path.c_str());
  }
  std::printf("\nmxflash-bench on %s, cuDNN %lld, warm-up %.1f s, window %.1f s, %d launches/sample, median\n",
              e.gpu_name.c_str(), (long long)e.cudnn_runtime_version, opt.warmup_s, opt.window_s, opt.launches);
  std::printf("reproduce: %s\n", opt.command_line.c_str());
  bool any_broadcast = false;
  for (const CaseSpec& c : opt.cases) any_broadcast |= c.broadcast_q;
  if (any_broadcast)
    std::printf("broadcast-Q cases: cuDNN runs Q materialized B times (it has no broadcast); FLOPs count Lq*sum(Lk)\n");
  for (const auto& [k, v] : rep.notes)
    if (k == "softmax" && v.rfind("causal", 0) == 0)
      std::printf("%s; FLOPs count the unmasked (row, key) pairs only: top_left row i attends keys j <= i, "
                  "bottom_right j <= i + Lk - Lq\n", v.c_str());
  if (!opt.cases.empty())
    std::printf("note = cuDNN tensor layout (dense BSHD | ragged THD + padding mask | padded BSHD + padding mask); "
                "cuDNN FP8 on sm_90 writes FP8 O/dQ/dK/dV\n");
  std::printf("\n");
  if (rep.cases.empty())
    std::printf("(nothing was measured)\n");
  else
    std::fputs(format_table(rep).c_str(), stdout);
  if (!check_pass) {
    std::fprintf(stderr, "mxflash-bench: --check failed (see the check lines above)\n");
    return 1;
  }
  return measured > 0 ? 0 : 1;
}

}  // namespace
}  // namespace mxflash::bench

int main(int argc, char** argv) {
  using namespace mxflash::bench;
  Options opt;
  const ParseResult pr = parse_args(argc, argv, &opt);
  if (!pr.ok) {
    std::fprintf(stderr, "mxflash-bench: error: %s\nRun 'mxflash-bench --help' for usage.\n", pr.error.c_str());
    return 2;
  }
  if (opt.help) {
    std::fputs(usage().c_str(), stdout);
    return 0;
  }
  return run(opt);
}
