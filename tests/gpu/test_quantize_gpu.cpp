// CUDA quantization == CPU reference, byte for byte, through the public API only: quantize (hdim,
// seq, square32, hdim+seq from one read), dequantize, payload and scale layout converters. Every
// output is poisoned before each run, so unwritten (padding) bytes are caught too.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "gpu/quantize_inputs.h"
#include "mxflash/jagged.h"
#include "mxflash/quantize.h"

namespace mxflash {
namespace {

using gputest::DeviceBuffer;
using gputest::kDevicePoison;
using gputest::kHostPoison;
using gputest::numel;
using gputest::same_bytes;
using gputest::view_of;

std::vector<int64_t> payload_dims(const JaggedMeta& m, int64_t H, PayloadLayout l) {
  int64_t s[3];
  payload_shape(m, H, l, s);
  return {s[0], s[1], s[2]};
}

std::vector<int64_t> scale_dims(const JaggedMeta& m, int64_t H, Orientation o, ScaleLayout l) {
  const ScaleShape s = scale_shape(m, H, o, l);
  return std::vector<int64_t>(s.dims, s.dims + s.ndim);
}

// One output tensor, run once on each device.
struct Output {
  std::vector<int64_t> shape;
  DType dtype;
  std::vector<uint8_t> cpu;
  DeviceBuffer gpu;
  Output(std::vector<int64_t> s, DType t, int elem_bytes = 1)
      : shape(std::move(s)), dtype(t), cpu(size_t(numel(shape) * elem_bytes), kHostPoison), gpu(cpu.size()) {
    gpu.fill(kDevicePoison);
  }
  TensorView cpu_view() { return view_of(cpu.data(), dtype, Device::kCPU, shape); }
  TensorView gpu_view() { return view_of(gpu.get(), dtype, Device::kCUDA, shape); }
  ::testing::AssertionResult matches() { return same_bytes(cpu, gpu.download()); }
};

// An input tensor present on both devices.
struct Input {
  std::vector<int64_t> shape;
  DType dtype;
  std::vector<uint8_t> host;
  DeviceBuffer dev;
  Input(std::vector<int64_t> s, DType t, std::vector<uint8_t> bytes)
      : shape(std::move(s)), dtype(t), host(std::move(bytes)), dev(host) {}
  TensorView cpu_view() { return view_of(host.data(), dtype, Device::kCPU, shape); }
  TensorView gpu_view() { return view_of(dev.get(), dtype, Device::kCUDA, shape); }
};

struct QuantCase {
  Orientation o;
  bool hdim_seq;  // quantize_hdim_seq (o is kSeq then)
  QuantizeOptions opt;
};

std::string describe(const QuantCase& c) {
  std::ostringstream s;
  s << (c.hdim_seq ? "hdim+seq" : to_string(c.o)) << " " << to_string(c.opt.mode) << " "
    << to_string(c.opt.scale_layout) << " " << to_string(c.opt.payload_layout);
  return s.str();
}

// Every orientation x mode x scale layout x valid payload layout (28 cases).
std::vector<QuantCase> all_quant_cases() {
  std::vector<QuantCase> cases;
  for (ScalingMode mode : {ScalingMode::kRceil, ScalingMode::kFloor}) {
    for (ScaleLayout sl : {ScaleLayout::kPlain, ScaleLayout::kBlocked128x4}) {
      cases.push_back({Orientation::kHdim, false, {mode, sl, PayloadLayout::kTokenMajor}});
      for (PayloadLayout pl : {PayloadLayout::kTokenMajor, PayloadLayout::kTokenContiguous}) {
        cases.push_back({Orientation::kSeq, false, {mode, sl, pl}});
        cases.push_back({Orientation::kSquare32, false, {mode, sl, pl}});
        cases.push_back({Orientation::kSeq, true, {mode, sl, pl}});
      }
    }
  }
  return cases;
}

void check_quantize(const JaggedMeta& meta, int64_t H, Input& x, const QuantCase& c) {
  SCOPED_TRACE(describe(c));
  if (!c.hdim_seq) {
    Output pay(payload_dims(meta, H, c.opt.payload_layout), DType::kE4M3);
    Output sc(scale_dims(meta, H, c.o, c.opt.scale_layout), DType::kE8M0);
    ASSERT_TRUE(quantize(x.cpu_view(), meta, c.o, c.opt, pay.cpu_view(), sc.cpu_view()).ok());
    const Status st = quantize(x.gpu_view(), meta, c.o, c.opt, pay.gpu_view(), sc.gpu_view());
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_TRUE(gputest::device_ok());
    EXPECT_TRUE(pay.matches()) << "payload";
    EXPECT_TRUE(sc.matches()) << "scales";
    return;
  }
  Output ph(payload_dims(meta, H, PayloadLayout::kTokenMajor), DType::kE4M3);
  Output sh(scale_dims(meta, H, Orientation::kHdim, c.opt.scale_layout), DType::kE8M0);
  Output ps(payload_dims(meta, H, c.opt.payload_layout), DType::kE4M3);
  Output ss(scale_dims(meta, H, Orientation::kSeq, c.opt.scale_layout), DType::kE8M0);
  ASSERT_TRUE(
      quantize_hdim_seq(x.cpu_view(), meta, c.opt, ph.cpu_view(), sh.cpu_view(), ps.cpu_view(), ss.cpu_view()).ok());
  const Status st =
      quantize_hdim_seq(x.gpu_view(), meta, c.opt, ph.gpu_view(), sh.gpu_view(), ps.gpu_view(), ss.gpu_view());
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  EXPECT_TRUE(ph.matches()) << "hdim payload";
  EXPECT_TRUE(sh.matches()) << "hdim scales";
  EXPECT_TRUE(ps.matches()) << "seq payload";
  EXPECT_TRUE(ss.matches()) << "seq scales";
}

// All 28 cases for bf16 and fp32 inputs drawn from one batch.
void check_all_quantize(const std::vector<int64_t>& lengths, int64_t H, uint64_t seed) {
  JaggedMeta meta;
  ASSERT_TRUE(JaggedMeta::FromLengths(lengths, &meta).ok());
  ASSERT_TRUE(meta.upload().ok());
  const std::vector<float> values = gputest::make_values(meta, H, seed);
  for (bool bf16 : {true, false}) {
    SCOPED_TRACE(bf16 ? "bf16 input" : "fp32 input");
    Input x({meta.total_tokens(), H, kHeadDim}, bf16 ? DType::kBFloat16 : DType::kFloat32,
            gputest::encode_input(values, bf16));
    for (const QuantCase& c : all_quant_cases()) {
      check_quantize(meta, H, x, c);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

std::string lengths_string(const std::vector<int64_t>& l) {
  std::ostringstream s;
  s << "lengths {";
  for (size_t i = 0; i < l.size(); ++i) s << (i ? ", " : "") << l[i];
  s << "}";
  return s.str();
}

TEST(QuantizeGpu, HostileLengthsOneHead) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  check_all_quantize(gputest::hostile_lengths(), 1, 1);
}

TEST(QuantizeGpu, HostileLengthsThreeHeads) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  check_all_quantize(gputest::hostile_lengths(), 3, 2);
}

TEST(QuantizeGpu, HostileLengthsSixteenHeads) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  check_all_quantize(gputest::hostile_lengths(), 16, 3);
}

TEST(QuantizeGpu, ManyEmptySequences) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  check_all_quantize(gputest::sparse_lengths(), 3, 4);
}

TEST(QuantizeGpu, RandomBatches) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t heads[] = {1, 2, 3, 5};
  for (uint64_t seed = 10; seed < 14; ++seed) {
    const std::vector<int64_t> lengths = gputest::random_lengths(seed);
    const int64_t H = heads[seed % 4];
    SCOPED_TRACE(lengths_string(lengths) + ", H " + std::to_string(H));
    check_all_quantize(lengths, H, seed);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// hdim+seq from bf16 on more 128-token strips (69 x 20 heads) than an H200 holds resident CTAs
// (132 SMs x 7). With the resident-wave launch (MXFLASH_QUANT_VARIANT=8; scripts/gpu_check.sh runs
// these tests so too) CTAs walk several strips and the prefetch of the next strip's first tile,
// across sequence and head boundaries, runs; the default launch gives each strip its own CTA.
TEST(QuantizeGpu, HdimSeqCtasWalkSeveralStrips) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  const std::vector<int64_t> lengths = {3000, 1, 0, 2049, 33, 127, 1500, 0, 129, 1000, 31, 256};
  const int64_t H = 20;
  JaggedMeta meta;
  ASSERT_TRUE(JaggedMeta::FromLengths(lengths, &meta).ok());
  ASSERT_TRUE(meta.upload().ok());
  Input x({meta.total_tokens(), H, kHeadDim}, DType::kBFloat16,
          gputest::encode_input(gputest::make_values(meta, H, 77), /*bf16=*/true));
  for (ScalingMode mode : {ScalingMode::kRceil, ScalingMode::kFloor})
    for (ScaleLayout sl : {ScaleLayout::kPlain, ScaleLayout::kBlocked128x4})
      for (PayloadLayout pl : {PayloadLayout::kTokenMajor, PayloadLayout::kTokenContiguous}) {
        check_quantize(meta, H, x, {Orientation::kSeq, true, {mode, sl, pl}});
        if (::testing::Test::HasFatalFailure()) return;
      }
}

// ---------------------------------------------------------------- dequantize
// Random payload and scale bytes cover every e4m3 code (NaN 0x7F/0xFF included) and every scale
// byte (0, 254, NaN 0xFF); padding bytes of the inputs are garbage the kernels must ignore.
TEST(DequantizeGpu, RandomBytesAllLayouts) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  uint64_t seed = 100;
  for (const auto& lengths : {gputest::hostile_lengths(), gputest::random_lengths(7), gputest::sparse_lengths()}) {
    for (int64_t H : {1, 3}) {
      SCOPED_TRACE(lengths_string(lengths) + ", H " + std::to_string(H));
      JaggedMeta meta;
      ASSERT_TRUE(JaggedMeta::FromLengths(lengths, &meta).ok());
      ASSERT_TRUE(meta.upload().ok());
      for (Orientation o : {Orientation::kHdim, Orientation::kSeq, Orientation::kSquare32}) {
        for (ScaleLayout sl : {ScaleLayout::kPlain, ScaleLayout::kBlocked128x4}) {
          for (PayloadLayout pl : {PayloadLayout::kTokenMajor, PayloadLayout::kTokenContiguous}) {
            if (o == Orientation::kHdim && pl == PayloadLayout::kTokenContiguous) continue;
            const auto pdims = payload_dims(meta, H, pl);
            const auto sdims = scale_dims(meta, H, o, sl);
            Input pay(pdims, DType::kE4M3, gputest::random_bytes(size_t(numel(pdims)), ++seed));
            Input sc(sdims, DType::kE8M0, gputest::random_bytes(size_t(numel(sdims)), ++seed));
            for (bool bf16 : {false, true}) {
              SCOPED_TRACE(std::string(to_string(o)) + " " + to_string(sl) + " " + to_string(pl) +
                           (bf16 ? " -> bf16" : " -> fp32"));
              const DType ot = bf16 ? DType::kBFloat16 : DType::kFloat32;
              Output out({meta.total_tokens(), H, kHeadDim}, ot, bf16 ? 2 : 4);
              ASSERT_TRUE(dequantize(pay.cpu_view(), sc.cpu_view(), meta, o, sl, pl, out.cpu_view()).ok());
              const Status st = dequantize(pay.gpu_view(), sc.gpu_view(), meta, o, sl, pl, out.gpu_view());
              ASSERT_TRUE(st.ok()) << st.message();
              ASSERT_TRUE(gputest::device_ok());
              EXPECT_TRUE(out.matches());
            }
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------- layout converters
TEST(LayoutGpu, PayloadConverters) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  uint64_t seed = 200;
  for (const auto& lengths : {gputest::hostile_lengths(), gputest::random_lengths(8), gputest::random_lengths(9),
                              gputest::sparse_lengths()}) {
    for (int64_t H : {1, 3, 16}) {
      SCOPED_TRACE(lengths_string(lengths) + ", H " + std::to_string(H));
      JaggedMeta meta;
      ASSERT_TRUE(JaggedMeta::FromLengths(lengths, &meta).ok());
      ASSERT_TRUE(meta.upload().ok());
      const auto major = payload_dims(meta, H, PayloadLayout::kTokenMajor);
      const auto contiguous = payload_dims(meta, H, PayloadLayout::kTokenContiguous);
      {
        SCOPED_TRACE("to_token_contiguous");
        Input src(major, DType::kE4M3, gputest::random_bytes(size_t(numel(major)), ++seed));
        Output dst(contiguous, DType::kE4M3);
        ASSERT_TRUE(to_token_contiguous(src.cpu_view(), meta, dst.cpu_view()).ok());
        const Status st = to_token_contiguous(src.gpu_view(), meta, dst.gpu_view());
        ASSERT_TRUE(st.ok()) << st.message();
        ASSERT_TRUE(gputest::device_ok());
        EXPECT_TRUE(dst.matches());
      }
      {
        SCOPED_TRACE("to_token_major");
        Input src(contiguous, DType::kE4M3, gputest::random_bytes(size_t(numel(contiguous)), ++seed));
        Output dst(major, DType::kE4M3);
        ASSERT_TRUE(to_token_major(src.cpu_view(), meta, dst.cpu_view()).ok());
        const Status st = to_token_major(src.gpu_view(), meta, dst.gpu_view());
        ASSERT_TRUE(st.ok()) << st.message();
        ASSERT_TRUE(gputest::device_ok());
        EXPECT_TRUE(dst.matches());
      }
    }
  }
}

TEST(LayoutGpu, ScaleConverters) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  uint64_t seed = 300;
  for (const auto& lengths : {gputest::hostile_lengths(), gputest::random_lengths(5), gputest::random_lengths(6),
                              gputest::sparse_lengths()}) {
    for (int64_t H : {1, 3, 16}) {
      SCOPED_TRACE(lengths_string(lengths) + ", H " + std::to_string(H));
      JaggedMeta meta;
      ASSERT_TRUE(JaggedMeta::FromLengths(lengths, &meta).ok());
      ASSERT_TRUE(meta.upload().ok());
      for (Orientation o : {Orientation::kHdim, Orientation::kSeq, Orientation::kSquare32}) {
        SCOPED_TRACE(to_string(o));
        const auto plain = scale_dims(meta, H, o, ScaleLayout::kPlain);
        const auto blocked = scale_dims(meta, H, o, ScaleLayout::kBlocked128x4);
        {
          Input src(plain, DType::kE8M0, gputest::random_bytes(size_t(numel(plain)), ++seed));
          Output dst(blocked, DType::kE8M0);
          ASSERT_TRUE(scales_to_blocked(src.cpu_view(), meta, H, o, dst.cpu_view()).ok());
          const Status st = scales_to_blocked(src.gpu_view(), meta, H, o, dst.gpu_view());
          ASSERT_TRUE(st.ok()) << st.message();
          ASSERT_TRUE(gputest::device_ok());
          EXPECT_TRUE(dst.matches()) << "scales_to_blocked";
        }
        {
          Input src(blocked, DType::kE8M0, gputest::random_bytes(size_t(numel(blocked)), ++seed));
          Output dst(plain, DType::kE8M0);
          ASSERT_TRUE(scales_to_plain(src.cpu_view(), meta, H, o, dst.cpu_view()).ok());
          const Status st = scales_to_plain(src.gpu_view(), meta, H, o, dst.gpu_view());
          ASSERT_TRUE(st.ok()) << st.message();
          ASSERT_TRUE(gputest::device_ok());
          EXPECT_TRUE(dst.matches()) << "scales_to_plain";
        }
      }
    }
  }
}

// ---------------------------------------------------------------- argument errors
TEST(QuantizeGpu, RejectsMixedDevicesWithoutWriting) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  JaggedMeta meta;
  ASSERT_TRUE(JaggedMeta::FromLengths({33, 0, 100}, &meta).ok());
  ASSERT_TRUE(meta.upload().ok());
  const int64_t H = 2;
  const std::vector<float> values = gputest::make_values(meta, H, 400);
  Input x({meta.total_tokens(), H, kHeadDim}, DType::kBFloat16, gputest::encode_input(values, true));
  const QuantizeOptions opt;
  Output pay(payload_dims(meta, H, PayloadLayout::kTokenMajor), DType::kE4M3);
  Output sc(scale_dims(meta, H, Orientation::kHdim, ScaleLayout::kPlain), DType::kE8M0);
  const std::vector<uint8_t> cpu_poison(pay.cpu.size(), kHostPoison);
  const std::vector<uint8_t> gpu_poison(pay.cpu.size(), kDevicePoison);

  // CPU x, CUDA payload and scales.
  Status st = quantize(x.cpu_view(), meta, Orientation::kHdim, opt, pay.gpu_view(), sc.gpu_view());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
  EXPECT_NE(st.message().find("payload"), std::string::npos) << st.message();
  // CUDA x, CPU payload.
  st = quantize(x.gpu_view(), meta, Orientation::kHdim, opt, pay.cpu_view(), sc.gpu_view());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
  // CUDA x and payload, CPU scales (hdim+seq entry point).
  Output ps(payload_dims(meta, H, PayloadLayout::kTokenMajor), DType::kE4M3);
  Output ss(scale_dims(meta, H, Orientation::kSeq, ScaleLayout::kPlain), DType::kE8M0);
  st = quantize_hdim_seq(x.gpu_view(), meta, opt, pay.gpu_view(), sc.gpu_view(), ps.gpu_view(), ss.cpu_view());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  EXPECT_TRUE(same_bytes(gpu_poison, pay.gpu.download())) << "payload written despite the error";
  EXPECT_TRUE(same_bytes(cpu_poison, pay.cpu)) << "payload written despite the error";
  EXPECT_TRUE(same_bytes(std::vector<uint8_t>(ps.cpu.size(), kDevicePoison), ps.gpu.download()));
  EXPECT_TRUE(same_bytes(std::vector<uint8_t>(ss.cpu.size(), kHostPoison), ss.cpu));

  // Dequantize and the converters go through the same device check.
  Output out({meta.total_tokens(), H, kHeadDim}, DType::kFloat32, 4);
  st = dequantize(pay.cpu_view(), sc.gpu_view(), meta, Orientation::kHdim, ScaleLayout::kPlain,
                  PayloadLayout::kTokenMajor, out.gpu_view());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
  Output tc(payload_dims(meta, H, PayloadLayout::kTokenContiguous), DType::kE4M3);
  st = to_token_contiguous(pay.cpu_view(), meta, tc.gpu_view());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  EXPECT_TRUE(same_bytes(std::vector<uint8_t>(out.cpu.size(), kDevicePoison), out.gpu.download()));
  EXPECT_TRUE(same_bytes(std::vector<uint8_t>(tc.cpu.size(), kDevicePoison), tc.gpu.download()));
}

// The kernels move 16-byte vectors: a view whose data pointer is not 16-byte aligned (possible
// with an offset into an allocation) is refused before anything is launched.
TEST(QuantizeGpu, RejectsMisalignedInputWithoutWriting) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  JaggedMeta meta;
  ASSERT_TRUE(JaggedMeta::FromLengths({40}, &meta).ok());
  ASSERT_TRUE(meta.upload().ok());
  const int64_t H = 1;
  DeviceBuffer x(size_t(meta.total_tokens() * H * kHeadDim * 2 + 16));
  x.fill(0);
  const TensorView xv =
      view_of(static_cast<uint8_t*>(x.get()) + 2, DType::kBFloat16, Device::kCUDA, {meta.total_tokens(), H, kHeadDim});
  Output pay(payload_dims(meta, H, PayloadLayout::kTokenMajor), DType::kE4M3);
  Output sc(scale_dims(meta, H, Orientation::kHdim, ScaleLayout::kPlain), DType::kE8M0);
  const Status st = quantize(xv, meta, Orientation::kHdim, QuantizeOptions{}, pay.gpu_view(), sc.gpu_view());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
  EXPECT_NE(st.message().find("aligned"), std::string::npos) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  EXPECT_TRUE(same_bytes(std::vector<uint8_t>(pay.cpu.size(), kDevicePoison), pay.gpu.download()));
  EXPECT_TRUE(same_bytes(std::vector<uint8_t>(sc.cpu.size(), kDevicePoison), sc.gpu.download()));
}

}  // namespace
}  // namespace mxflash
