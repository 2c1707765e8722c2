// Argument validation of the quantization launchers (include/mxflash/quantize.h): each test makes
// one change to a call that is otherwise valid (the baseline tests show those succeed) and expects
// a failed Status with the right code, a message that starts with the argument's name, and every
// output byte still holding its poison. CUDA-tagged views carry dummy pointers: a launcher that
// dereferenced one before rejecting it would crash the test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "mxflash/jagged.h"
#include "mxflash/quantize.h"
#include "mxflash/tensor.h"

namespace mxflash {
namespace {

constexpr uint8_t kPoison = 0xA5;
constexpr int64_t kD = 128;
void* const kDummyDevicePtr = reinterpret_cast<void*>(uintptr_t(0x1000));

struct Poisoned {
  std::vector<uint8_t> mem = std::vector<uint8_t>(size_t(1) << 20, kPoison);  // larger than any view here
  void* data() { return mem.data(); }
  bool untouched() const { return std::all_of(mem.begin(), mem.end(), [](uint8_t b) { return b == kPoison; }); }
  void repoison() { std::fill(mem.begin(), mem.end(), kPoison); }
};

TensorView view(void* data, DType t, std::vector<int64_t> shape, Device dev = Device::kCPU, int dev_id = 0) {
  return make_view(data, t, dev, int(shape.size()), shape.data(), dev_id);
}
TensorView with_strides(TensorView v, std::vector<int64_t> strides) {
  for (size_t i = 0; i < strides.size(); ++i) v.stride[i] = strides[i];
  return v;
}
TensorView on_cuda(TensorView v, int dev_id = 0) {
  v.device = Device::kCUDA;
  v.device_id = dev_id;
  v.data = kDummyDevicePtr;
  return v;
}

class Validation : public ::testing::Test {
 protected:
  static constexpr int64_t H = 2, T = 57, P = 256;  // lengths {17, 0, 40}

  void SetUp() override {
    ASSERT_TRUE(JaggedMeta::FromLengths({17, 0, 40}, &meta).ok());
    ASSERT_EQ(meta.total_tokens(), T);
    ASSERT_EQ(meta.padded_tokens(), P);
    x32.assign(size_t(2 * T * H * kD), 1.f);  // twice the size: room for strided views
    xbf.assign(size_t(2 * T * H * kD), 0x3F80);
    in_bytes.assign(size_t(4 * H * kD * P), 0x38);
  }

  TensorView x(DType t = DType::kFloat32) {
    return view(t == DType::kBFloat16 ? static_cast<void*>(xbf.data()) : static_cast<void*>(x32.data()), t, {T, H, kD});
  }
  static std::vector<int64_t> payload_dims(PayloadLayout l) {
    return l == PayloadLayout::kTokenMajor ? std::vector<int64_t>{T, H, kD} : std::vector<int64_t>{H, kD, P};
  }
  static std::vector<int64_t> scale_dims(Orientation o, ScaleLayout l) {
    if (l == ScaleLayout::kBlocked128x4) return o == Orientation::kSeq ? std::vector<int64_t>{H * 32, P / 8}
                                                                       : std::vector<int64_t>{H * P / 4, 16};
    if (o == Orientation::kHdim) return {T, H, 4};
    if (o == Orientation::kSeq) return {P / 32, H, kD};
    return {P / 32, H, 4};
  }
  TensorView payload(Poisoned& m, PayloadLayout l = PayloadLayout::kTokenMajor) {
    return view(m.data(), DType::kE4M3, payload_dims(l));
  }
  TensorView scales(Poisoned& m, Orientation o, ScaleLayout l = ScaleLayout::kPlain) {
    return view(m.data(), DType::kE8M0, scale_dims(o, l));
  }
  // Read-only byte inputs (payload or scales) of any shape.
  TensorView input_bytes(std::vector<int64_t> shape, DType t = DType::kE4M3) { return view(in_bytes.data(), t, shape); }

  bool all_untouched() const { return a.untouched() && b.untouched() && c.untouched() && d.untouched(); }

  void expect_rejected(const Status& st, const std::string& arg, const std::string& also = "",
                       StatusCode code = StatusCode::kInvalidArgument) {
    EXPECT_FALSE(st.ok()) << "expected a rejection naming '" << arg << "'";
    EXPECT_EQ(int(st.code()), int(code)) << st.message();
    EXPECT_EQ(st.message().rfind(arg + ":", 0), 0u) << "message should start with '" << arg << ":': " << st.message();
    if (!also.empty()) {
      EXPECT_NE(st.message().find(also), std::string::npos) << "'" << also << "' not in: " << st.message();
    }
    EXPECT_TRUE(all_untouched()) << "an output was written by a rejected call: " << st.message();
  }

  JaggedMeta meta;
  std::vector<float> x32;
  std::vector<uint16_t> xbf;
  std::vector<uint8_t> in_bytes;
  Poisoned a, b, c, d;  // outputs
};

constexpr Orientation kOrients[] = {Orientation::kHdim, Orientation::kSeq, Orientation::kSquare32};
constexpr ScaleLayout kScaleLayouts[] = {ScaleLayout::kPlain, ScaleLayout::kBlocked128x4};

// ---------------------------------------------------------------- baselines

TEST_F(Validation, BaselinesSucceed) {
  for (Orientation o : kOrients)
    for (ScaleLayout sl : kScaleLayouts)
      for (PayloadLayout pl : {PayloadLayout::kTokenMajor, PayloadLayout::kTokenContiguous}) {
        if (o == Orientation::kHdim && pl == PayloadLayout::kTokenContiguous) continue;
        for (DType xt : {DType::kFloat32, DType::kBFloat16}) {
          TensorView pv = payload(a, pl), sv = scales(b, o, sl);
          EXPECT_TRUE(quantize(x(xt), meta, o, {ScalingMode::kFloor, sl, pl}, pv, sv).ok());
          pv.dtype = DType::kUInt8;
          sv.dtype = DType::kUInt8;
          EXPECT_TRUE(quantize(x(xt), meta, o, {ScalingMode::kRceil, sl, pl}, pv, sv).ok());
        }
        EXPECT_TRUE(dequantize(input_bytes(payload_dims(pl)), input_bytes(scale_dims(o, sl), DType::kE8M0), meta, o, sl,
                               pl, view(c.data(), DType::kFloat32, {T, H, kD}))
                        .ok());
      }
  for (ScaleLayout sl : kScaleLayouts)
    for (PayloadLayout pl : {PayloadLayout::kTokenMajor, PayloadLayout::kTokenContiguous})
      EXPECT_TRUE(quantize_hdim_seq(x(), meta, {ScalingMode::kRceil, sl, pl}, payload(a), scales(b, Orientation::kHdim, sl),
                                    payload(c, pl), scales(d, Orientation::kSeq, sl))
                      .ok());
  EXPECT_TRUE(to_token_contiguous(input_bytes({T, H, kD}), meta, payload(a, PayloadLayout::kTokenContiguous)).ok());
  EXPECT_TRUE(to_token_major(input_bytes({H, kD, P}), meta, payload(a)).ok());
  for (Orientation o : kOrients) {
    EXPECT_TRUE(scales_to_blocked(input_bytes(scale_dims(o, ScaleLayout::kPlain), DType::kE8M0), meta, H, o,
                                  scales(a, o, ScaleLayout::kBlocked128x4)).ok());
    EXPECT_TRUE(scales_to_plain(input_bytes(scale_dims(o, ScaleLayout::kBlocked128x4), DType::kUInt8), meta, H, o,
                                scales(a, o, ScaleLayout::kPlain)).ok());
  }
}

// ---------------------------------------------------------------- quantize: metadata and enums

TEST_F(Validation, QuantizeRejectsEmptyMeta) {
  const JaggedMeta empty;
  expect_rejected(quantize(x(), empty, Orientation::kHdim, {}, payload(a), scales(b, Orientation::kHdim)), "meta");
}

TEST_F(Validation, QuantizeRejectsInvalidEnums) {
  const TensorView pv = payload(a), sv = scales(b, Orientation::kHdim);
  for (int bad : {-1, 3, 100})
    expect_rejected(quantize(x(), meta, Orientation(bad), {}, pv, sv), "orientation");
  for (int bad : {-1, 2})
    expect_rejected(quantize(x(), meta, Orientation::kHdim, {ScalingMode(bad)}, pv, sv), "mode");
  for (int bad : {-1, 2})
    expect_rejected(quantize(x(), meta, Orientation::kHdim, {ScalingMode::kRceil, ScaleLayout(bad)}, pv, sv),
                    "scale_layout");
  for (int bad : {-1, 2})
    expect_rejected(quantize(x(), meta, Orientation::kSeq,
                             {ScalingMode::kRceil, ScaleLayout::kPlain, PayloadLayout(bad)}, pv,
                             scales(b, Orientation::kSeq)),
                    "payload_layout");
}

TEST_F(Validation, QuantizeRejectsTokenContiguousHdim) {
  expect_rejected(quantize(x(), meta, Orientation::kHdim,
                           {ScalingMode::kRceil, ScaleLayout::kPlain, PayloadLayout::kTokenContiguous},
                           payload(a, PayloadLayout::kTokenContiguous), scales(b, Orientation::kHdim)),
                  "payload_layout", "hdim");
}

// ---------------------------------------------------------------- quantize: x

TEST_F(Validation, QuantizeRejectsXDtype) {
  for (DType t : {DType::kFloat16, DType::kInt32, DType::kE4M3, DType::kUInt8, DType::kE8M0, DType(42)}) {
    TensorView xv = x();
    xv.dtype = t;
    expect_rejected(quantize(xv, meta, Orientation::kHdim, {}, payload(a), scales(b, Orientation::kHdim)), "x", "dtype");
  }
}

TEST_F(Validation, QuantizeRejectsXShape) {
  auto run = [&](std::vector<int64_t> shape) {
    return quantize(view(x32.data(), DType::kFloat32, shape), meta, Orientation::kHdim, {}, payload(a),
                    scales(b, Orientation::kHdim));
  };
  expect_rejected(run({T, H * kD}), "x", "3-D");
  expect_rejected(run({T, H, 1, kD}), "x", "3-D");
  expect_rejected(run({T * H * kD}), "x");
  expect_rejected(run({T, H * 2, 64}), "x", "128");
  expect_rejected(run({T, H / 2, 256}), "x", "128");
  expect_rejected(run({T, 0, kD}), "x", "head count");
  expect_rejected(run({T + 1, H, kD}), "x", "token count");
  expect_rejected(run({T - 1, H, kD}), "x", "token count");
  expect_rejected(run({P, H, kD}), "x", "token count");  // padded count is not the token count
}

TEST_F(Validation, QuantizeRejectsNonContiguousX) {
  const TensorView pv = payload(a), sv = scales(b, Orientation::kHdim);
  expect_rejected(quantize(with_strides(x(), {2 * H * kD, kD, 1}), meta, Orientation::kHdim, {}, pv, sv), "x",
                  "contiguous");                                               // gaps between tokens
  expect_rejected(quantize(with_strides(x(), {kD, T * kD, 1}), meta, Orientation::kHdim, {}, pv, sv), "x",
                  "contiguous");                                               // (H, T, 128) memory
  expect_rejected(quantize(with_strides(x(), {H * kD, kD, 2}), meta, Orientation::kHdim, {}, pv, sv), "x",
                  "contiguous");                                               // strided head dim
  expect_rejected(quantize(with_strides(x(), {H * kD, 0, 1}), meta, Orientation::kHdim, {}, pv, sv), "x",
                  "contiguous");                                               // broadcast heads
}

TEST_F(Validation, QuantizeRejectsNullX) {
  expect_rejected(quantize(view(nullptr, DType::kFloat32, {T, H, kD}), meta, Orientation::kHdim, {}, payload(a),
                           scales(b, Orientation::kHdim)),
                  "x", "null");
}

// ---------------------------------------------------------------- quantize: payload

TEST_F(Validation, QuantizeRejectsPayloadDtype) {
  for (DType t : {DType::kBFloat16, DType::kFloat32, DType::kInt32, DType::kE8M0, DType::kFloat16}) {
    TensorView pv = payload(a);
    pv.dtype = t;
    expect_rejected(quantize(x(), meta, Orientation::kHdim, {}, pv, scales(b, Orientation::kHdim)), "payload", "dtype");
  }
}

TEST_F(Validation, QuantizeRejectsPayloadShapePerLayout) {
  const std::vector<std::vector<int64_t>> bad_tm = {
      {T + 1, H, kD}, {T, H + 1, kD}, {T, H, 64}, {T, H * kD}, {H, kD, P}, {P, H, kD}, {T, H, kD, 1}};
  for (const auto& s : bad_tm)
    expect_rejected(quantize(x(), meta, Orientation::kSeq, {}, view(a.data(), DType::kE4M3, s),
                             scales(b, Orientation::kSeq)),
                    "payload", "shape");
  const std::vector<std::vector<int64_t>> bad_tc = {
      {H, kD, T}, {H, kD, P + 128}, {T, H, kD}, {kD, H, P}, {H + 1, kD, P}, {H * kD, P}};
  const QuantizeOptions tc{ScalingMode::kRceil, ScaleLayout::kPlain, PayloadLayout::kTokenContiguous};
  for (Orientation o : {Orientation::kSeq, Orientation::kSquare32})
    for (const auto& s : bad_tc)
      expect_rejected(quantize(x(), meta, o, tc, view(a.data(), DType::kE4M3, s), scales(b, o)), "payload", "shape");
}

TEST_F(Validation, QuantizeRejectsNonContiguousOrNullPayload) {
  expect_rejected(quantize(x(), meta, Orientation::kHdim, {}, with_strides(payload(a), {H * kD + 1, kD, 1}),
                           scales(b, Orientation::kHdim)),
                  "payload", "contiguous");
  const QuantizeOptions tc{ScalingMode::kRceil, ScaleLayout::kPlain, PayloadLayout::kTokenContiguous};
  expect_rejected(quantize(x(), meta, Orientation::kSeq, tc,
                           with_strides(payload(a, PayloadLayout::kTokenContiguous), {1, H, H * kD}),
                           scales(b, Orientation::kSeq)),
                  "payload", "contiguous");
  expect_rejected(quantize(x(), meta, Orientation::kHdim, {}, view(nullptr, DType::kE4M3, {T, H, kD}),
                           scales(b, Orientation::kHdim)),
                  "payload", "null");
}

// ---------------------------------------------------------------- quantize: scales

TEST_F(Validation, QuantizeRejectsScalesDtype) {
  for (DType t : {DType::kE4M3, DType::kBFloat16, DType::kFloat32, DType::kInt32}) {
    TensorView sv = scales(b, Orientation::kSeq);
    sv.dtype = t;
    expect_rejected(quantize(x(), meta, Orientation::kSeq, {}, payload(a), sv), "scales", "dtype");
  }
}

// Every other orientation/layout's shape, and near misses, are rejected for each (o, layout).
TEST_F(Validation, QuantizeRejectsScalesShapePerOrientationAndLayout) {
  for (Orientation o : kOrients)
    for (ScaleLayout sl : kScaleLayouts) {
      SCOPED_TRACE(std::string(to_string(o)) + "/" + to_string(sl));
      const auto good = scale_dims(o, sl);
      std::vector<std::vector<int64_t>> bad;
      for (Orientation o2 : kOrients)
        for (ScaleLayout sl2 : kScaleLayouts)
          if (scale_dims(o2, sl2) != good) bad.push_back(scale_dims(o2, sl2));
      auto s = good;
      s[0] += 1;
      bad.push_back(s);
      s = good;
      s.back() += 1;
      bad.push_back(s);
      s = good;
      s[0] -= 1;
      bad.push_back(s);
      bad.push_back({good[0] * good[1] * (good.size() > 2 ? good[2] : 1)});
      if (sl == ScaleLayout::kPlain && o != Orientation::kHdim) bad.push_back({T / 32 + 1, H, good[2]});  // unpadded groups
      if (sl == ScaleLayout::kBlocked128x4 && o != Orientation::kSeq) bad.push_back({H * T / 4, 16});
      for (const auto& bs : bad)
        expect_rejected(quantize(x(), meta, o, {ScalingMode::kRceil, sl}, payload(a), view(b.data(), DType::kE8M0, bs)),
                        "scales", "shape");
    }
}

TEST_F(Validation, QuantizeRejectsNonContiguousOrNullScales) {
  expect_rejected(quantize(x(), meta, Orientation::kSeq, {}, payload(a),
                           with_strides(scales(b, Orientation::kSeq), {1, P / 32, H * P / 32})),
                  "scales", "contiguous");
  expect_rejected(quantize(x(), meta, Orientation::kHdim, {ScalingMode::kRceil, ScaleLayout::kBlocked128x4}, payload(a),
                           with_strides(scales(b, Orientation::kHdim, ScaleLayout::kBlocked128x4), {32, 1})),
                  "scales", "contiguous");
  expect_rejected(quantize(x(), meta, Orientation::kSquare32, {}, payload(a),
                           view(nullptr, DType::kE8M0, scale_dims(Orientation::kSquare32, ScaleLayout::kPlain))),
                  "scales", "null");
}

// ---------------------------------------------------------------- devices

TEST_F(Validation, QuantizeRejectsMixedDevicesBeforeTouchingMemory) {
  const TensorView pv = payload(a), sv = scales(b, Orientation::kHdim);
  expect_rejected(quantize(x(), meta, Orientation::kHdim, {}, on_cuda(pv), sv), "payload", "same device");
  expect_rejected(quantize(x(), meta, Orientation::kHdim, {}, pv, on_cuda(sv)), "scales", "same device");
  // x on the device, outputs on the host: the host outputs are the mismatch.
  TensorView xv = on_cuda(x());
  expect_rejected(quantize(xv, meta, Orientation::kHdim, {}, pv, sv), "payload", "same device");
  // all on CUDA but one on another device
  expect_rejected(quantize(xv, meta, Orientation::kHdim, {}, on_cuda(pv), on_cuda(sv, 1)), "scales", "same device");
}

// A device value that is neither CPU nor CUDA must not reach a backend.
TEST_F(Validation, QuantizeRejectsInvalidDeviceEnum) {
  TensorView xv = x(), pv = payload(a), sv = scales(b, Orientation::kHdim);
  xv.device = pv.device = sv.device = Device(7);
  expect_rejected(quantize(xv, meta, Orientation::kHdim, {}, pv, sv), "x", "device");
  TensorView pv2 = payload(a);
  pv2.device = Device(-1);
  expect_rejected(quantize(x(), meta, Orientation::kHdim, {}, pv2, scales(b, Orientation::kHdim)), "payload");
}

// CUDA views need a CUDA build, and (in one) metadata uploaded with meta.upload().
TEST_F(Validation, QuantizeCudaViewsNeedCudaBuildAndUploadedMeta) {
  const TensorView xv = on_cuda(x()), pv = on_cuda(payload(a)), sv = on_cuda(scales(b, Orientation::kHdim));
  const Status st = quantize(xv, meta, Orientation::kHdim, {}, pv, sv);
#if defined(MXFLASH_WITH_CUDA)
  if (st.code() == StatusCode::kCudaError) GTEST_SKIP() << "no usable CUDA device: " << st.message();
  ASSERT_FALSE(meta.on_device());
  expect_rejected(st, "meta", "upload");
#else
  expect_rejected(st, "x", "CUDA", StatusCode::kUnsupported);
  JaggedMeta m2 = meta;
  const Status up = m2.upload();
  EXPECT_EQ(int(up.code()), int(StatusCode::kUnsupported)) << up.message();
  EXPECT_FALSE(m2.on_device());
  expect_rejected(quantize_hdim_seq(xv, meta, {}, pv, sv, on_cuda(payload(c)), on_cuda(scales(d, Orientation::kSeq))),
                  "x", "CUDA", StatusCode::kUnsupported);
  expect_rejected(dequantize(on_cuda(input_bytes({T, H, kD})), on_cuda(input_bytes({T, H, 4}, DType::kE8M0)), meta,
                             Orientation::kHdim, ScaleLayout::kPlain, PayloadLayout::kTokenMajor,
                             on_cuda(view(c.data(), DType::kFloat32, {T, H, kD}))),
                  "payload", "CUDA", StatusCode::kUnsupported);
  expect_rejected(to_token_contiguous(on_cuda(input_bytes({T, H, kD})), meta,
                                      on_cuda(payload(a, PayloadLayout::kTokenContiguous))),
                  "src", "CUDA", StatusCode::kUnsupported);
  expect_rejected(scales_to_blocked(on_cuda(input_bytes({T, H, 4}, DType::kE8M0)), meta, H, Orientation::kHdim,
                                    on_cuda(scales(a, Orientation::kHdim, ScaleLayout::kBlocked128x4))),
                  "plain", "CUDA", StatusCode::kUnsupported);
#endif
}

// ---------------------------------------------------------------- quantize_hdim_seq

TEST_F(Validation, HdimSeqRejectsEachOutputByName) {
  const QuantizeOptions opt{};
  auto call = [&](TensorView ph, TensorView sh, TensorView ps, TensorView ss, const QuantizeOptions& o) {
    return quantize_hdim_seq(x(), meta, o, ph, sh, ps, ss);
  };
  const TensorView ph = payload(a), sh = scales(b, Orientation::kHdim), ps = payload(c), ss = scales(d, Orientation::kSeq);
  // dtype
  TensorView t = ph;
  t.dtype = DType::kBFloat16;
  expect_rejected(call(t, sh, ps, ss, opt), "payload_hdim", "dtype");
  t = sh;
  t.dtype = DType::kFloat32;
  expect_rejected(call(ph, t, ps, ss, opt), "scales_hdim", "dtype");
  t = ps;
  t.dtype = DType::kInt32;
  expect_rejected(call(ph, sh, t, ss, opt), "payload_seq", "dtype");
  t = ss;
  t.dtype = DType::kE4M3;
  expect_rejected(call(ph, sh, ps, t, opt), "scales_seq", "dtype");
  // shapes: each tensor given another's shape
  expect_rejected(call(payload(a, PayloadLayout::kTokenContiguous), sh, ps, ss, opt), "payload_hdim", "shape");
  expect_rejected(call(ph, scales(b, Orientation::kSeq), ps, ss, opt), "scales_hdim", "shape");
  expect_rejected(call(ph, sh, payload(c, PayloadLayout::kTokenContiguous), ss, opt), "payload_seq", "shape");
  expect_rejected(call(ph, sh, ps, scales(d, Orientation::kHdim), opt), "scales_seq", "shape");
  expect_rejected(call(ph, sh, ps, scales(d, Orientation::kSquare32), opt), "scales_seq", "shape");
  // token_contiguous applies to the seq payload only; the scale layout to both scale tensors
  const QuantizeOptions tc{ScalingMode::kRceil, ScaleLayout::kPlain, PayloadLayout::kTokenContiguous};
  expect_rejected(call(ph, sh, ps, ss, tc), "payload_seq", "shape");
  expect_rejected(call(payload(a, PayloadLayout::kTokenContiguous), sh, payload(c, PayloadLayout::kTokenContiguous), ss, tc),
                  "payload_hdim", "shape");
  const QuantizeOptions blk{ScalingMode::kRceil, ScaleLayout::kBlocked128x4};
  expect_rejected(call(ph, sh, ps, scales(d, Orientation::kSeq, ScaleLayout::kBlocked128x4), blk), "scales_hdim", "shape");
  expect_rejected(call(ph, scales(b, Orientation::kHdim, ScaleLayout::kBlocked128x4), ps, ss, blk), "scales_seq", "shape");
  // null
  expect_rejected(call(view(nullptr, DType::kE4M3, {T, H, kD}), sh, ps, ss, opt), "payload_hdim", "null");
  expect_rejected(call(ph, view(nullptr, DType::kE8M0, {T, H, 4}), ps, ss, opt), "scales_hdim", "null");
  expect_rejected(call(ph, sh, view(nullptr, DType::kE4M3, {T, H, kD}), ss, opt), "payload_seq", "null");
  expect_rejected(call(ph, sh, ps, view(nullptr, DType::kE8M0, {P / 32, H, kD}), opt), "scales_seq", "null");
  // non-contiguous
  expect_rejected(call(ph, sh, with_strides(ps, {H * kD, 1, H}), ss, opt), "payload_seq", "contiguous");
  // devices
  expect_rejected(call(on_cuda(ph), sh, ps, ss, opt), "payload_hdim", "same device");
  expect_rejected(call(ph, on_cuda(sh), ps, ss, opt), "scales_hdim", "same device");
  expect_rejected(call(ph, sh, on_cuda(ps), ss, opt), "payload_seq", "same device");
  expect_rejected(call(ph, sh, ps, on_cuda(ss), opt), "scales_seq", "same device");
  // enums, metadata, x
  expect_rejected(call(ph, sh, ps, ss, {ScalingMode(5)}), "mode");
  expect_rejected(call(ph, sh, ps, ss, {ScalingMode::kRceil, ScaleLayout(9)}), "scale_layout");
  expect_rejected(call(ph, sh, ps, ss, {ScalingMode::kRceil, ScaleLayout::kPlain, PayloadLayout(9)}), "payload_layout");
  expect_rejected(quantize_hdim_seq(x(), JaggedMeta{}, opt, ph, sh, ps, ss), "meta");
  TensorView xv = x();
  xv.dtype = DType::kFloat16;
  expect_rejected(quantize_hdim_seq(xv, meta, opt, ph, sh, ps, ss), "x", "dtype");
  expect_rejected(quantize_hdim_seq(view(x32.data(), DType::kFloat32, {T, H, 64}), meta, opt, ph, sh, ps, ss), "x", "128");
}

// ---------------------------------------------------------------- dequantize

TEST_F(Validation, DequantizeRejects) {
  const TensorView pay_in = input_bytes({T, H, kD}), sc_in = input_bytes({T, H, 4}, DType::kE8M0);
  const TensorView out = view(c.data(), DType::kFloat32, {T, H, kD});
  auto call = [&](TensorView p, TensorView s, TensorView o, Orientation orient = Orientation::kHdim,
                  ScaleLayout sl = ScaleLayout::kPlain, PayloadLayout pl = PayloadLayout::kTokenMajor,
                  const JaggedMeta* m = nullptr) { return dequantize(p, s, m ? *m : meta, orient, sl, pl, o); };
  // out
  for (DType t : {DType::kE4M3, DType::kFloat16, DType::kInt32, DType::kUInt8}) {
    TensorView o = out;
    o.dtype = t;
    expect_rejected(call(pay_in, sc_in, o), "out", "dtype");
  }
  expect_rejected(call(pay_in, sc_in, view(c.data(), DType::kFloat32, {T, H, 64})), "out", "128");
  expect_rejected(call(pay_in, sc_in, view(c.data(), DType::kFloat32, {T + 1, H, kD})), "out", "token count");
  expect_rejected(call(pay_in, sc_in, view(c.data(), DType::kFloat32, {T, H * kD})), "out", "3-D");
  expect_rejected(call(pay_in, sc_in, view(nullptr, DType::kFloat32, {T, H, kD})), "out", "null");
  expect_rejected(call(pay_in, sc_in, with_strides(out, {H * kD * 2, kD, 1})), "out", "contiguous");
  // payload and scales
  TensorView p = pay_in;
  p.dtype = DType::kBFloat16;
  expect_rejected(call(p, sc_in, out), "payload", "dtype");
  expect_rejected(call(input_bytes({H, kD, P}), sc_in, out), "payload", "shape");
  expect_rejected(call(pay_in, sc_in, out, Orientation::kSeq, ScaleLayout::kPlain, PayloadLayout::kTokenContiguous),
                  "payload", "shape");
  TensorView s = sc_in;
  s.dtype = DType::kFloat32;
  expect_rejected(call(pay_in, s, out), "scales", "dtype");
  expect_rejected(call(pay_in, sc_in, out, Orientation::kSeq), "scales", "shape");
  expect_rejected(call(pay_in, sc_in, out, Orientation::kHdim, ScaleLayout::kBlocked128x4), "scales", "shape");
  expect_rejected(call(pay_in, input_bytes({H * P / 4, 16}, DType::kE8M0), out, Orientation::kSeq,
                       ScaleLayout::kBlocked128x4),
                  "scales", "shape");
  expect_rejected(call(view(nullptr, DType::kE4M3, {T, H, kD}), sc_in, out), "payload", "null");
  expect_rejected(call(pay_in, view(nullptr, DType::kE8M0, {T, H, 4}), out), "scales", "null");
  expect_rejected(call(pay_in, with_strides(sc_in, {4, T * 4, 1}), out), "scales", "contiguous");
  expect_rejected(call(with_strides(pay_in, {kD, T * kD, 1}), sc_in, out), "payload", "contiguous");
  // enums and metadata
  expect_rejected(call(input_bytes({H, kD, P}), sc_in, out, Orientation::kHdim, ScaleLayout::kPlain,
                       PayloadLayout::kTokenContiguous),
                  "payload_layout", "hdim");
  expect_rejected(call(pay_in, sc_in, out, Orientation(3)), "orientation");
  expect_rejected(call(pay_in, sc_in, out, Orientation::kHdim, ScaleLayout(2)), "scale_layout");
  expect_rejected(call(pay_in, sc_in, out, Orientation::kSeq, ScaleLayout::kPlain, PayloadLayout(2)), "payload_layout");
  const JaggedMeta empty;
  expect_rejected(call(pay_in, sc_in, out, Orientation::kHdim, ScaleLayout::kPlain, PayloadLayout::kTokenMajor, &empty),
                  "meta");
  // devices
  expect_rejected(call(pay_in, sc_in, on_cuda(out)), "out", "same device");
  expect_rejected(call(pay_in, on_cuda(sc_in), out), "scales", "same device");
  expect_rejected(call(on_cuda(pay_in), sc_in, out), "scales", "same device");
}

// ---------------------------------------------------------------- payload converters

TEST_F(Validation, ToTokenContiguousRejects) {
  const TensorView src = input_bytes({T, H, kD}), dst = payload(a, PayloadLayout::kTokenContiguous);
  expect_rejected(to_token_contiguous(src, JaggedMeta{}, dst), "meta");
  expect_rejected(to_token_contiguous(input_bytes({T, H * kD}), meta, dst), "src", "3-D");
  expect_rejected(to_token_contiguous(input_bytes({T, 0, kD}), meta, dst), "src", "head count");
  expect_rejected(to_token_contiguous(input_bytes({T + 1, H, kD}), meta, dst), "src", "shape");
  expect_rejected(to_token_contiguous(input_bytes({T, H, 64}), meta, dst), "src", "shape");
  expect_rejected(to_token_contiguous(input_bytes({H, kD, P}), meta, dst), "src", "shape");
  for (DType t : {DType::kFloat32, DType::kBFloat16, DType::kInt32}) {
    TensorView s = src;
    s.dtype = t;
    expect_rejected(to_token_contiguous(s, meta, dst), "src", "dtype");
    TensorView dd = dst;
    dd.dtype = t;
    expect_rejected(to_token_contiguous(src, meta, dd), "dst", "dtype");
  }
  expect_rejected(to_token_contiguous(view(nullptr, DType::kUInt8, {T, H, kD}), meta, dst), "src", "null");
  expect_rejected(to_token_contiguous(with_strides(src, {kD, T * kD, 1}), meta, dst), "src", "contiguous");
  expect_rejected(to_token_contiguous(src, meta, view(a.data(), DType::kE4M3, {H, kD, T})), "dst", "shape");
  expect_rejected(to_token_contiguous(src, meta, view(a.data(), DType::kE4M3, {H + 1, kD, P})), "dst", "shape");
  expect_rejected(to_token_contiguous(src, meta, view(a.data(), DType::kE4M3, {T, H, kD})), "dst", "shape");
  expect_rejected(to_token_contiguous(src, meta, view(nullptr, DType::kE4M3, {H, kD, P})), "dst", "null");
  expect_rejected(to_token_contiguous(src, meta, with_strides(dst, {1, H, H * kD})), "dst", "contiguous");
  expect_rejected(to_token_contiguous(src, meta, on_cuda(dst)), "dst", "same device");
  expect_rejected(to_token_contiguous(on_cuda(src), meta, dst), "dst", "same device");
}

TEST_F(Validation, ToTokenMajorRejects) {
  const TensorView src = input_bytes({H, kD, P}), dst = payload(a);
  expect_rejected(to_token_major(src, JaggedMeta{}, dst), "meta");
  expect_rejected(to_token_major(input_bytes({H * kD, P}), meta, dst), "src", "3-D");
  expect_rejected(to_token_major(input_bytes({0, kD, P}), meta, dst), "src", "head count");
  expect_rejected(to_token_major(input_bytes({H, kD, T}), meta, dst), "src", "shape");
  expect_rejected(to_token_major(input_bytes({H, 64, P}), meta, dst), "src", "shape");
  expect_rejected(to_token_major(input_bytes({T, H, kD}), meta, dst), "src");
  TensorView s = src;
  s.dtype = DType::kFloat32;
  expect_rejected(to_token_major(s, meta, dst), "src", "dtype");
  TensorView dd = dst;
  dd.dtype = DType::kBFloat16;
  expect_rejected(to_token_major(src, meta, dd), "dst", "dtype");
  expect_rejected(to_token_major(src, meta, view(a.data(), DType::kE4M3, {T, H + 1, kD})), "dst", "shape");
  expect_rejected(to_token_major(src, meta, view(a.data(), DType::kE4M3, {P, H, kD})), "dst", "shape");
  expect_rejected(to_token_major(src, meta, view(nullptr, DType::kE4M3, {T, H, kD})), "dst", "null");
  expect_rejected(to_token_major(view(nullptr, DType::kE4M3, {H, kD, P}), meta, dst), "src", "null");
  expect_rejected(to_token_major(src, meta, with_strides(dst, {H * kD + 7, kD, 1})), "dst", "contiguous");
  expect_rejected(to_token_major(src, meta, on_cuda(dst)), "dst", "same device");
}

// ---------------------------------------------------------------- scale converters

TEST_F(Validation, ScaleConvertersReject) {
  for (Orientation o : kOrients) {
    SCOPED_TRACE(to_string(o));
    const TensorView plain_in = input_bytes(scale_dims(o, ScaleLayout::kPlain), DType::kE8M0);
    const TensorView blocked_in = input_bytes(scale_dims(o, ScaleLayout::kBlocked128x4), DType::kE8M0);
    const TensorView blocked_out = scales(a, o, ScaleLayout::kBlocked128x4);
    const TensorView plain_out = scales(b, o, ScaleLayout::kPlain);
    for (int64_t h : {int64_t(0), int64_t(-1)}) {
      expect_rejected(scales_to_blocked(plain_in, meta, h, o, blocked_out), "heads");
      expect_rejected(scales_to_plain(blocked_in, meta, h, o, plain_out), "heads");
    }
    expect_rejected(scales_to_blocked(plain_in, meta, H + 1, o, blocked_out), "plain", "shape");
    expect_rejected(scales_to_plain(blocked_in, meta, H + 1, o, plain_out), "blocked", "shape");
    expect_rejected(scales_to_blocked(plain_in, JaggedMeta{}, H, o, blocked_out), "meta");
    expect_rejected(scales_to_plain(blocked_in, JaggedMeta{}, H, o, plain_out), "meta");
    // layouts swapped
    expect_rejected(scales_to_blocked(blocked_in, meta, H, o, blocked_out), "plain", "shape");
    expect_rejected(scales_to_blocked(plain_in, meta, H, o, scales(a, o, ScaleLayout::kPlain)), "blocked", "shape");
    expect_rejected(scales_to_plain(plain_in, meta, H, o, plain_out), "blocked", "shape");
    expect_rejected(scales_to_plain(blocked_in, meta, H, o, scales(b, o, ScaleLayout::kBlocked128x4)), "plain", "shape");
    // another orientation's plain shape
    const Orientation other = o == Orientation::kSeq ? Orientation::kHdim : Orientation::kSeq;
    expect_rejected(scales_to_blocked(input_bytes(scale_dims(other, ScaleLayout::kPlain), DType::kE8M0), meta, H, o, blocked_out),
                    "plain", "shape");
    expect_rejected(scales_to_plain(blocked_in, meta, H, o, scales(b, other, ScaleLayout::kPlain)), "plain", "shape");
    // dtypes, null, strides, devices
    TensorView t = plain_in;
    t.dtype = DType::kFloat32;
    expect_rejected(scales_to_blocked(t, meta, H, o, blocked_out), "plain", "dtype");
    t.dtype = DType::kE4M3;  // scale tensors are e8m0 (or raw uint8), not e4m3
    expect_rejected(scales_to_blocked(t, meta, H, o, blocked_out), "plain", "dtype");
    t = blocked_in;
    t.dtype = DType::kE4M3;
    expect_rejected(scales_to_plain(t, meta, H, o, plain_out), "blocked", "dtype");
    t = blocked_out;
    t.dtype = DType::kInt32;
    expect_rejected(scales_to_blocked(plain_in, meta, H, o, t), "blocked", "dtype");
    t = plain_out;
    t.dtype = DType::kBFloat16;
    expect_rejected(scales_to_plain(blocked_in, meta, H, o, t), "plain", "dtype");
    t = blocked_out;
    t.data = nullptr;
    expect_rejected(scales_to_blocked(plain_in, meta, H, o, t), "blocked", "null");
    t = plain_out;
    t.data = nullptr;
    expect_rejected(scales_to_plain(blocked_in, meta, H, o, t), "plain", "null");
    expect_rejected(scales_to_blocked(plain_in, meta, H, o, with_strides(blocked_out, {1, blocked_out.shape[0]})),
                    "blocked", "contiguous");
    expect_rejected(scales_to_blocked(plain_in, meta, H, o, on_cuda(blocked_out)), "blocked", "same device");
    expect_rejected(scales_to_plain(blocked_in, meta, H, o, on_cuda(plain_out)), "plain", "same device");
  }
  expect_rejected(scales_to_blocked(input_bytes({T, H, 4}, DType::kE8M0), meta, H, Orientation(3),
                                    scales(a, Orientation::kHdim, ScaleLayout::kBlocked128x4)),
                  "orientation");
  expect_rejected(scales_to_plain(input_bytes({H * P / 4, 16}, DType::kE8M0), meta, H, Orientation(-2),
                                  scales(b, Orientation::kHdim)),
                  "orientation");
}

}  // namespace
}  // namespace mxflash
