// mxflash-report: the project's main job, readable by a person.
// Without a GPU it runs the CPU reference on a small jagged workload; with a Hopper GPU it also runs
// the CUDA path on the same inputs and checks GPU == CPU byte for byte. Exit 1 on any mismatch.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "mxflash/quantize.h"

#ifdef MXFLASH_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {
using namespace mxflash;

struct Options {
  std::vector<int64_t> lengths = {0, 1, 31, 32, 33, 127, 128, 129, 1000, 4096};
  int64_t heads = 3;
  uint64_t seed = 1;
  bool cpu_only = false;
};

void usage() {
  std::printf(
      "usage: mxflash-report [--lengths L1,L2,...] [--heads H] [--seed S] [--cpu-only]\n"
      "Quantizes a random jagged (T, H, 128) BF16 batch in every MX orientation and mode, reports the\n"
      "round-trip SQNR, and compares the GPU kernels with the CPU reference when a GPU is present.\n");
}

bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "mxflash-report: %s needs a value\n", flag);
        return nullptr;
      }
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else if (a == "--lengths") {
      const char* v = next("--lengths");
      if (!v) return false;
      o->lengths.clear();
      std::string s = v;
      size_t p = 0;
      while (p <= s.size()) {
        size_t q = s.find(',', p);
        if (q == std::string::npos) q = s.size();
        try {
          o->lengths.push_back(std::stoll(s.substr(p, q - p)));
        } catch (...) {
          std::fprintf(stderr, "mxflash-report: --lengths: '%s' is not a list of integers\n", v);
          return false;
        }
        p = q + 1;
      }
    } else if (a == "--heads") {
      const char* v = next("--heads");
      if (!v) return false;
      o->heads = std::atoll(v);
      if (o->heads < 1) {
        std::fprintf(stderr, "mxflash-report: --heads must be >= 1\n");
        return false;
      }
    } else if (a == "--seed") {
      const char* v = next("--seed");
      if (!v) return false;
      o->seed = std::strtoull(v, nullptr, 10);
    } else if (a == "--cpu-only") {
      o->cpu_only = true;
    } else {
      std::fprintf(stderr, "mxflash-report: unknown flag '%s' (see --help)\n", a.c_str());
      return false;
    }
  }
  return true;
}

struct Case {
  Orientation o;
  ScalingMode mode;
  ScaleLayout layout;
  PayloadLayout payload;
};

double sqnr_db(const std::vector<float>& ref, const std::vector<float>& out) {
  double s = 0, n = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    s += double(ref[i]) * ref[i];
    const double d = double(out[i]) - ref[i];
    n += d * d;
  }
  return n == 0 ? INFINITY : 10 * std::log10(s / n);
}

int fail(const Status& s, const char* what) {
  std::fprintf(stderr, "mxflash-report: %s failed: %s\n", what, s.message().c_str());
  return 1;
}

#ifdef MXFLASH_WITH_CUDA
bool gpu_present(std::string* name) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return false;
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return false;
  *name = p.name;
  return p.major == 9;
}

// Runs one case on the GPU and returns payload and scale bytes.
Status run_gpu(const std::vector<uint16_t>& x, const JaggedMeta& meta, int64_t H, const Case& c,
               const QuantizeOptions& opt, std::vector<uint8_t>* payload, std::vector<uint8_t>* scales) {
  void *dx = nullptr, *dp = nullptr, *ds = nullptr;
  auto chk = [](cudaError_t e) { return e == cudaSuccess ? Status::Ok() : Status::Cuda(cudaGetErrorString(e)); };
  Status st = chk(cudaMalloc(&dx, x.size() * 2));
  if (st.ok()) st = chk(cudaMalloc(&dp, payload->size()));
  if (st.ok()) st = chk(cudaMalloc(&ds, scales->size()));
  if (st.ok()) st = chk(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  if (st.ok()) st = chk(cudaMemset(dp, 0xA5, payload->size()));  // poisoned: every byte must be written
  if (st.ok()) st = chk(cudaMemset(ds, 0xA5, scales->size()));
  if (st.ok()) {
    int64_t ps[3];
    payload_shape(meta, H, opt.payload_layout, ps);
    const ScaleShape ss = scale_shape(meta, H, c.o, opt.scale_layout);
    st = quantize(make_view(dx, DType::kBFloat16, Device::kCUDA, {meta.total_tokens(), H, kHeadDim}), meta, c.o, opt,
                  make_view(dp, DType::kE4M3, Device::kCUDA, 3, ps), make_view(ds, DType::kE8M0, Device::kCUDA, ss.ndim, ss.dims));
  }
  if (st.ok()) st = chk(cudaDeviceSynchronize());
  if (st.ok()) st = chk(cudaMemcpy(payload->data(), dp, payload->size(), cudaMemcpyDeviceToHost));
  if (st.ok()) st = chk(cudaMemcpy(scales->data(), ds, scales->size(), cudaMemcpyDeviceToHost));
  cudaFree(dx);
  cudaFree(dp);
  cudaFree(ds);
  return st;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  if (!parse(argc, argv, &opt)) return 2;
  JaggedMeta meta;
  Status st = JaggedMeta::FromLengths(opt.lengths, &meta);
  if (!st.ok()) return fail(st, "metadata");
  const int64_t H = opt.heads, T = meta.total_tokens(), n = T * H * kHeadDim;

  // Random BF16 input with a spread of magnitudes across tokens (normal * 2^U(-8, 8)).
  std::mt19937_64 rng(opt.seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> expo(-8, 8);
  std::vector<uint16_t> x(static_cast<size_t>(n));
  std::vector<float> xf(static_cast<size_t>(n));
  for (int64_t t = 0; t < T; ++t) {
    const float mag = std::ldexp(1.f, expo(rng));
    for (int64_t i = 0; i < H * kHeadDim; ++i) {
      const size_t k = size_t(t * H * kHeadDim + i);
      x[k] = float_to_bf16(normal(rng) * mag);
      xf[k] = bf16_to_float(x[k]);
    }
  }

  bool gpu = false;
  std::string gpu_name = "none";
#ifdef MXFLASH_WITH_CUDA
  if (!opt.cpu_only) gpu = gpu_present(&gpu_name);
  if (gpu) {
    st = meta.upload();
    if (!st.ok()) return fail(st, "metadata upload");
  }
#endif
  std::printf("mxflash-report: MX quantization of a jagged BF16 batch\n");
  std::printf("  sequences %d, lengths", meta.batch());
  for (int64_t L : opt.lengths) std::printf(" %lld", (long long)L);
  std::printf("\n  tokens %lld (padded %lld), heads %lld, head dim %d, seed %llu\n", (long long)T,
              (long long)meta.padded_tokens(), (long long)H, kHeadDim, (unsigned long long)opt.seed);
  std::printf("  GPU: %s\n\n", gpu ? gpu_name.c_str() : (opt.cpu_only ? "skipped (--cpu-only)" : "none (CPU reference only)"));
  std::printf("  %-9s %-6s %-13s %-17s %12s  %s\n", "orient", "mode", "scales", "payload", "SQNR dB", "GPU == CPU");

  const Case cases[] = {
      {Orientation::kHdim, ScalingMode::kRceil, ScaleLayout::kPlain, PayloadLayout::kTokenMajor},
      {Orientation::kHdim, ScalingMode::kFloor, ScaleLayout::kBlocked128x4, PayloadLayout::kTokenMajor},
      {Orientation::kSeq, ScalingMode::kRceil, ScaleLayout::kPlain, PayloadLayout::kTokenMajor},
      {Orientation::kSeq, ScalingMode::kRceil, ScaleLayout::kBlocked128x4, PayloadLayout::kTokenContiguous},
      {Orientation::kSeq, ScalingMode::kFloor, ScaleLayout::kPlain, PayloadLayout::kTokenMajor},
      {Orientation::kSquare32, ScalingMode::kRceil, ScaleLayout::kPlain, PayloadLayout::kTokenMajor},
      {Orientation::kSquare32, ScalingMode::kFloor, ScaleLayout::kBlocked128x4, PayloadLayout::kTokenContiguous},
  };
  int mismatches = 0;
  for (const Case& c : cases) {
    QuantizeOptions qo;
    qo.mode = c.mode;
    qo.scale_layout = c.layout;
    qo.payload_layout = c.payload;
    int64_t ps[3];
    payload_shape(meta, H, c.payload, ps);
    const ScaleShape ss = scale_shape(meta, H, c.o, c.layout);
    std::vector<uint8_t> payload(size_t(ps[0] * ps[1] * ps[2])), scales(size_t(ss.numel()));
    st = quantize(make_view(x.data(), DType::kBFloat16, Device::kCPU, {T, H, kHeadDim}), meta, c.o, qo,
                  make_view(payload.data(), DType::kE4M3, Device::kCPU, 3, ps),
                  make_view(scales.data(), DType::kE8M0, Device::kCPU, ss.ndim, ss.dims));
    if (!st.ok()) return fail(st, "quantize (CPU)");
    std::vector<float> back(static_cast<size_t>(n));
    st = dequantize(make_view(payload.data(), DType::kE4M3, Device::kCPU, 3, ps),
                    make_view(scales.data(), DType::kE8M0, Device::kCPU, ss.ndim, ss.dims), meta, c.o, c.layout,
                    c.payload, make_view(back.data(), DType::kFloat32, Device::kCPU, {T, H, kHeadDim}));
    if (!st.ok()) return fail(st, "dequantize (CPU)");
    std::string verdict = "n/a";
#ifdef MXFLASH_WITH_CUDA
    if (gpu) {
      std::vector<uint8_t> gp(payload.size()), gs(scales.size());
      st = run_gpu(x, meta, H, c, qo, &gp, &gs);
      if (!st.ok()) return fail(st, "quantize (GPU)");
      const bool same = gp == payload && gs == scales;
      mismatches += !same;
      verdict = same ? "yes (" + std::to_string(gp.size() + gs.size()) + " bytes)" : "NO";
    }
#endif
    std::printf("  %-9s %-6s %-13s %-17s %12.2f  %s\n", to_string(c.o), to_string(c.mode), to_string(c.layout),
                to_string(c.payload), sqnr_db(xf, back), verdict.c_str());
  }
  std::printf("\n%s\n", mismatches ? "FAILED: GPU and CPU disagree" : "ok");
  return mismatches ? 1 : 0;
}
