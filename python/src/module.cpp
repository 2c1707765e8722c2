// _mxflash: the nanobind layer under the `mxflash` Python package.
//
// Deliberately thin. The package (python/mxflash/__init__.py) resolves dtypes and devices and
// allocates outputs with numpy or torch; it passes each tensor here as a raw view tuple
//   (data pointer, dtype code, device code, device id, shape, strides in elements)
// and this layer builds TensorViews and calls the C++ API, so every argument check, and its
// message, is the library's own. A failed Status becomes ValueError (kInvalidArgument) or
// RuntimeError (anything else) carrying the message verbatim.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(MXFLASH_WITH_CUDA)
#include <cuda_runtime.h>
#endif

#include "mxflash/attention.h"
#include "mxflash/fused.h"
#include "mxflash/jagged.h"
#include "mxflash/mx.h"
#include "mxflash/quantize.h"
#include "mxflash/status.h"
#include "mxflash/tensor.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mxflash {
namespace {

// (data, dtype code, device code, device id, shape, strides in elements)
using View = std::tuple<uintptr_t, int, int, int, std::vector<int64_t>, std::vector<int64_t>>;

constexpr int kNumDTypes = 7;  // DType::kFloat32 .. DType::kUInt8

// Resets the CUDA runtime's last-error state after a failure (a no-op without CUDA): a failed
// runtime call (cudaSetDevice, cudaMalloc, ...) leaves its error behind, and a later launcher that
// checks cudaGetLastError() after its launch would report it as its own.
void clear_cuda_error() {
#if defined(MXFLASH_WITH_CUDA)
  (void)cudaGetLastError();
#endif
}

void throw_if_error(const Status& s) {
  if (s.ok()) return;
  clear_cuda_error();
  if (s.code() == StatusCode::kInvalidArgument) throw nb::value_error(s.message().c_str());
  throw std::runtime_error(s.message());
}

TensorView to_view(const View& v, const char* name) {
  const auto& [data, dtype, device, device_id, shape, stride] = v;
  if (dtype < 0 || dtype >= kNumDTypes) throw nb::value_error((std::string(name) + ": unknown dtype code").c_str());
  if (device != int(Device::kCPU) && device != int(Device::kCUDA))
    throw nb::value_error((std::string(name) + ": unknown device code").c_str());
  if (shape.size() != stride.size() || shape.size() > size_t(kMaxDims))
    throw nb::value_error((std::string(name) + ": at most " + std::to_string(kMaxDims) +
                           " dimensions, with one stride per dimension")
                              .c_str());
  TensorView t;
  t.data = reinterpret_cast<void*>(data);
  t.dtype = DType(dtype);
  t.device = Device(device);
  t.device_id = device_id;
  t.ndim = int(shape.size());
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = shape[size_t(i)];
    t.stride[i] = stride[size_t(i)];
  }
  return t;
}

// Makes the tensors' CUDA device current for the call and restores the previous one, as a
// framework device guard does (the launchers require the tensors' device to be current).
class DeviceGuard {
 public:
  DeviceGuard(const TensorView& t) {
#if defined(MXFLASH_WITH_CUDA)
    if (t.device != Device::kCUDA) return;
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != t.device_id) {
      check(cudaSetDevice(t.device_id), "cudaSetDevice");
      restore_ = true;
    }
#else
    (void)t;
#endif
  }
  ~DeviceGuard() {
#if defined(MXFLASH_WITH_CUDA)
    if (restore_) cudaSetDevice(prev_);
#endif
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
#if defined(MXFLASH_WITH_CUDA)
  static void check(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return;
    clear_cuda_error();
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  }
#endif
  int prev_ = -1;
  bool restore_ = false;
};

void* as_stream(uintptr_t s) { return reinterpret_cast<void*>(s); }

// A kv_heads argument: 0 (as many as heads) or a divisor of heads (grouped-query attention).
void check_kv_heads(int64_t heads, int64_t kv_heads) {
  if (kv_heads != 0 && (kv_heads < 1 || heads % kv_heads != 0))
    throw nb::value_error(("kv_heads: must divide heads (" + std::to_string(heads) + "), got " +
                           std::to_string(kv_heads)).c_str());
}

// One MX operand: (payload view, scales view, orientation, scale layout, payload layout codes).
// The codes pass through unchecked; the attention launcher rejects out-of-range ones by name.
using Mx = std::tuple<View, View, int, int, int>;

MxTensor to_mx(const Mx& m, const char* name) {
  const auto& [payload, scales, o, scale_layout, payload_layout] = m;
  MxTensor t;
  t.payload = to_view(payload, (std::string(name) + ".payload").c_str());
  t.scales = to_view(scales, (std::string(name) + ".scales").c_str());
  t.orientation = Orientation(o);
  t.scale_layout = ScaleLayout(scale_layout);
  t.payload_layout = PayloadLayout(payload_layout);
  return t;
}

// The execution-layout forward operands: views of (q, q_scale, k, k_scale, v, v_scale), named
// ops.q ... ops.v_scale as the library names them (or set.q ... for another set name).
using Ops = std::tuple<View, View, View, View, View, View>;
// The execution-layout backward operands: views of (q, q_scale, k, k_scale, v, v_scale, qt, qt_scale,
// kt, kt_scale), named alike.
using BwdOps = std::tuple<View, View, View, View, View, View, View, View, View, View>;

// The six leading parts both sets share, q ... v_scale, from tuple elements 0..5.
template <typename Tuple, typename Set>
void leading_views(const Tuple& o, const std::string& set, Set* t) {
  auto n = [&](const char* f) { return set + "." + f; };
  t->q = to_view(std::get<0>(o), n("q").c_str());
  t->q_scale = to_view(std::get<1>(o), n("q_scale").c_str());
  t->k = to_view(std::get<2>(o), n("k").c_str());
  t->k_scale = to_view(std::get<3>(o), n("k_scale").c_str());
  t->v = to_view(std::get<4>(o), n("v").c_str());
  t->v_scale = to_view(std::get<5>(o), n("v_scale").c_str());
}

AttentionFwdOperands to_ops(const Ops& o, const std::string& set = "ops") {
  AttentionFwdOperands t;
  leading_views(o, set, &t);
  return t;
}

AttentionBwdOperands to_bwd_ops(const BwdOps& o, const std::string& set = "ops") {
  AttentionBwdOperands t;
  leading_views(o, set, &t);
  t.qt = to_view(std::get<6>(o), (set + ".qt").c_str());
  t.qt_scale = to_view(std::get<7>(o), (set + ".qt_scale").c_str());
  t.kt = to_view(std::get<8>(o), (set + ".kt").c_str());
  t.kt_scale = to_view(std::get<9>(o), (set + ".kt_scale").c_str());
  return t;
}

AttentionBackwardOptions backward_options(double softmax_scale, bool broadcast_q, int dq_accum, int dq_fp16_scale_log2,
                                          int p_scale, bool output_mxfp8_dkv, bool exact_mx, int causal) {
  AttentionBackwardOptions opt;
  opt.softmax_scale = float(softmax_scale);
  opt.causal = CausalMask(causal);
  opt.broadcast_q = broadcast_q;
  opt.dq_accum = DqAccum(dq_accum);
  opt.dq_fp16_scale_log2 = dq_fp16_scale_log2;
  opt.p_scale = PScaleMode(p_scale);
  opt.output_mxfp8_dkv = output_mxfp8_dkv;
  opt.exact_mx = exact_mx;
  return opt;
}

// `causal`: a CausalMask code (0 none, 1 top_left, 2 bottom_right; CAUSAL_MASKS), passed through
// unchecked as the other enum codes are (the package validates the Python spelling first).
AttentionOptions attention_options(double softmax_scale, bool broadcast_q, int causal) {
  AttentionOptions opt;
  opt.softmax_scale = float(softmax_scale);  // NaN: the library default 1/sqrt(128)
  opt.causal = CausalMask(causal);
  opt.broadcast_q = broadcast_q;
  return opt;
}

JaggedMeta meta_from_cu_seqlens(const std::vector<int64_t>& cu, const char* name) {
  std::vector<int32_t> c(cu.size());
  for (size_t i = 0; i < cu.size(); ++i) {
    if (cu[i] < std::numeric_limits<int32_t>::min() || cu[i] > std::numeric_limits<int32_t>::max())
      throw nb::value_error((std::string(name) + ": entry " + std::to_string(i) + " = " + std::to_string(cu[i]) +
                             " does not fit in int32")
                                .c_str());
    c[i] = int32_t(cu[i]);
  }
  JaggedMeta m;
  throw_if_error(JaggedMeta::FromCuSeqlens(c, &m));
  return m;
}

std::vector<int32_t> to_int32(const std::vector<int64_t>& v, const char* name) {
  std::vector<int32_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] < std::numeric_limits<int32_t>::min() || v[i] > std::numeric_limits<int32_t>::max())
      throw nb::value_error((std::string(name) + ": entry " + std::to_string(i) + " = " + std::to_string(v[i]) +
                             " does not fit in int32")
                                .c_str());
    out[i] = int32_t(v[i]);
  }
  return out;
}

// ------------------------------------------------------------------ the autograd step's host path
// mx_attention's training step (python/mxflash/autograd.py) with its operands in two caller buffers
// instead of ten tensors: `saved` holds what the backward reads (Q', K', and the backward's V rows,
// Qᵀ', Kᵀ' with their scales; Q' and K' only without training), `scratch` the forward's V' and its
// scale, then the forward's workspace. One allocation each, one view each, one call each way: the
// Python layer's ~40 tensor conversions and ~17 allocations a step were most of its host time
// (docs/performance.md). Parts at 256-byte offsets, in the public orders of
// attention_{fwd,bwd}_operand_bytes.
struct StepLayout {
  size_t fwd[kAttentionFwdOperandCount] = {};  // q, k, v, q_scale, k_scale, v_scale (v, v_scale in scratch)
  size_t bwd[kAttentionBwdOperandCount] = {};  // q, k, v, qt, kt, then their scales (all in saved)
  size_t saved = 0, scratch = 0, workspace_at = 0, workspace = 0;
};

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

StepLayout step_layout(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t H, int64_t Hkv, bool training,
                       const AttentionOptions& opt, bool cuda) {
  StepLayout l;
  size_t fb[kAttentionFwdOperandCount], bb[kAttentionBwdOperandCount];
  attention_fwd_operand_bytes(q_meta, k_meta, H, fb, Hkv);
  attention_bwd_operand_bytes(q_meta, k_meta, H, bb, Hkv);
  auto take = [](size_t* end, size_t bytes) {
    const size_t at = *end;
    *end += align256(bytes);
    return at;
  };
  for (int i : {0, 1, 3, 4}) l.fwd[i] = take(&l.saved, fb[i]);  // Q', K' and their scales
  // the backward's q, k, q_scale, k_scale are the forward's
  for (const auto& [b, f] : {std::pair{0, 0}, std::pair{1, 1}, std::pair{5, 3}, std::pair{6, 4}}) l.bwd[b] = l.fwd[f];
  if (training)
    for (int i : {2, 3, 4, 7, 8, 9}) l.bwd[i] = take(&l.saved, bb[i]);
  for (int i : {2, 5}) l.fwd[i] = take(&l.scratch, fb[i]);  // V' (the forward's alone)
  l.workspace_at = l.scratch;
  l.workspace = cuda ? attention_forward_operands_workspace_size(q_meta, k_meta, H, opt) : 0;
  l.scratch += l.workspace;
  return l;
}

// `name`: a uint8 buffer of at least `bytes` on `like`'s device, 16-byte aligned (the parts' offsets
// are multiples of 256; the payloads need 16); its base pointer.
uint8_t* step_buffer(const TensorView& b, const char* name, size_t bytes, const TensorView& like) {
  if (b.ndim != 1 || (b.dtype != DType::kUInt8 && b.dtype != DType::kE4M3) || size_t(b.shape[0]) < bytes ||
      b.device != like.device || (b.device == Device::kCUDA && b.device_id != like.device_id) ||
      (bytes > 0 && b.data == nullptr) || reinterpret_cast<uintptr_t>(b.data) % 16 != 0)
    throw nb::value_error((std::string(name) + ": must be a 16-byte aligned uint8 buffer of at least " +
                           std::to_string(bytes) + " bytes on the inputs' device")
                              .c_str());
  return static_cast<uint8_t*>(b.data);
}

// The operand sets over the step's buffers (bwd's parts past Q', K' only with training).
void step_operands(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t H, int64_t Hkv, const StepLayout& l,
                   uint8_t* saved, uint8_t* scratch, const TensorView& like, AttentionFwdOperands* fwd,
                   AttentionBwdOperands* bwd) {
  void* fp[kAttentionFwdOperandCount];
  void* bp[kAttentionBwdOperandCount];
  for (int i = 0; i < kAttentionFwdOperandCount; ++i) fp[i] = (i == 2 || i == 5 ? scratch : saved) + l.fwd[i];
  for (int i = 0; i < kAttentionBwdOperandCount; ++i) bp[i] = saved + l.bwd[i];
  if (fwd) *fwd = attention_fwd_operand_views(q_meta, k_meta, H, fp, like.device, like.device_id, Hkv);
  if (bwd) *bwd = attention_bwd_operand_views(q_meta, k_meta, H, bp, like.device, like.device_id, Hkv);
}

// H from q (T, H, 128), Hkv from k (T, Hkv, 128); 1 where malformed (the calls then reject them by name).
int64_t heads_of(const TensorView& x) { return x.ndim == 3 && x.shape[1] >= 1 ? x.shape[1] : 1; }

template <typename E>
nb::dict enum_names(int count) {
  nb::dict d;
  for (int i = 0; i < count; ++i) d[to_string(E(i))] = i;
  return d;
}

// Vectorized scalar codecs over 1-D contiguous CPU arrays (for testing against ml_dtypes).
template <typename T>
using Vec = nb::ndarray<T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void check_same_size(size_t a, size_t b) {
  if (a != b) throw nb::value_error("src and dst must have the same number of elements");
}

}  // namespace
}  // namespace mxflash

NB_MODULE(_mxflash, m) {
  using namespace mxflash;
  m.doc() = "mxflash C++ bindings (internal; use the mxflash package)";
  // A training script that still holds autograd graphs at exit (its last loss, an out) holds the
  // JaggedMeta objects their nodes keep; Python finalizes them after this module, and nanobind would
  // print them as leaked at every such exit. Not leaks: the warnings are off unless
  // MXFLASH_NB_LEAK_WARNINGS=1 (for hunting real reference-count bugs in these bindings).
  {
    const char* w = std::getenv("MXFLASH_NB_LEAK_WARNINGS");
    nb::set_leak_warnings(w != nullptr && w[0] == '1');
  }

#if defined(MXFLASH_WITH_CUDA)
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  {
    nb::dict dt;
    for (int i = 0; i < kNumDTypes; ++i) dt[to_string(DType(i))] = i;
    m.attr("DTYPES") = dt;
  }
  m.attr("DEVICE_CPU") = int(Device::kCPU);
  m.attr("DEVICE_CUDA") = int(Device::kCUDA);
  m.attr("ORIENTATIONS") = enum_names<Orientation>(3);
  m.attr("MODES") = enum_names<ScalingMode>(2);
  {
    nb::dict paths;
    paths["auto"] = int(GemmPath::kAuto);
    paths["exact"] = int(GemmPath::kExact);
    paths["coarse"] = int(GemmPath::kCoarse);
    m.attr("GEMM_PATHS") = paths;
  }
  m.attr("SCALE_LAYOUTS") = enum_names<ScaleLayout>(2);
  m.attr("PAYLOAD_LAYOUTS") = enum_names<PayloadLayout>(2);
  {
    nb::dict masks;  // AttentionOptions::causal, AttentionBackwardOptions::causal
    for (CausalMask c : {CausalMask::kNone, CausalMask::kTopLeft, CausalMask::kBottomRight})
      masks[causal_name(c)] = int(c);  // the library's names
    m.attr("CAUSAL_MASKS") = masks;
  }
  m.attr("BLOCK_SIZE") = kBlockSize;
  m.attr("HEAD_DIM") = kHeadDim;
  m.attr("SEQ_PAD") = kSeqPad;
  m.attr("E4M3_MAX") = kE4m3Max;

  // ------------------------------------------------------------------ JaggedMeta
  nb::class_<JaggedMeta>(m, "JaggedMeta")
      .def_static(
          "from_lengths",
          [](const std::vector<int64_t>& lengths) {
            JaggedMeta out;
            throw_if_error(JaggedMeta::FromLengths(lengths, &out));
            return out;
          },
          "lengths"_a)
      .def_static(
          "from_cu_seqlens", [](const std::vector<int64_t>& cu) { return meta_from_cu_seqlens(cu, "cu_seqlens"); },
          "cu_seqlens"_a)
      .def_static(
          "check_cu_seqlens_sf",
          [](const std::vector<int64_t>& cu, const std::vector<int64_t>& sf) {
            throw_if_error(JaggedMeta::CheckCuSeqlensSf(to_int32(cu, "cu_seqlens"), to_int32(sf, "cu_seqlens_sf")));
          },
          "cu_seqlens"_a, "cu_seqlens_sf"_a)
      .def_prop_ro("batch", &JaggedMeta::batch)
      .def_prop_ro("total_tokens", &JaggedMeta::total_tokens)
      .def_prop_ro("padded_tokens", &JaggedMeta::padded_tokens)
      .def_prop_ro("max_seqlen", &JaggedMeta::max_seqlen)
      .def_prop_ro("cu_seqlens", [](const JaggedMeta& self) { return self.cu_seqlens(); })
      .def_prop_ro("cu_seqlens_sf", [](const JaggedMeta& self) { return self.cu_seqlens_sf(); })
      .def_prop_ro("on_device", &JaggedMeta::on_device)
      // A fresh copy of this metadata with its device copy on CUDA device `device_id` (copies made
      // by the C++ copy constructor share one device allocation, so each device needs its own).
      .def(
          "uploaded_copy",
          [](const JaggedMeta& self, int device_id) {
            JaggedMeta out;
            throw_if_error(JaggedMeta::FromCuSeqlens(self.cu_seqlens(), &out));
            TensorView where;
            where.device = Device::kCUDA;
            where.device_id = device_id;
            DeviceGuard guard(where);
            throw_if_error(out.upload());
            return out;
          },
          "device_id"_a);

  m.def(
      "scale_shape",
      [](const JaggedMeta& meta, int64_t heads, int o, int layout) {
        if (o < 0 || o > 2) throw nb::value_error("orientation: must be hdim, seq or square32");
        if (layout < 0 || layout > 1) throw nb::value_error("layout: must be plain or blocked128x4");
        if (heads < 1) throw nb::value_error("heads: must be >= 1");
        const ScaleShape s = scale_shape(meta, heads, Orientation(o), ScaleLayout(layout));
        return std::vector<int64_t>(s.dims, s.dims + s.ndim);
      },
      "meta"_a, "heads"_a, "orientation"_a, "layout"_a);
  m.def(
      "payload_shape",
      [](const JaggedMeta& meta, int64_t heads, int layout) {
        if (layout < 0 || layout > 1) throw nb::value_error("layout: must be token_major or token_contiguous");
        if (heads < 1) throw nb::value_error("heads: must be >= 1");
        int64_t s[3];
        payload_shape(meta, heads, PayloadLayout(layout), s);
        return std::vector<int64_t>(s, s + 3);
      },
      "meta"_a, "heads"_a, "layout"_a);

  // ------------------------------------------------------------------ tensor entry points
  // The integer enum arguments are passed through unchecked: the launchers reject values out of
  // range with their own messages (the package maps unknown names to -1).
  m.def(
      "quantize",
      [](const JaggedMeta& meta, const View& x, int o, int mode, int scale_layout, int payload_layout,
         const View& payload, const View& scales, uintptr_t stream) {
        const TensorView tx = to_view(x, "x");
        const TensorView tp = to_view(payload, "payload"), ts = to_view(scales, "scales");
        QuantizeOptions opt;
        opt.mode = ScalingMode(mode);
        opt.scale_layout = ScaleLayout(scale_layout);
        opt.payload_layout = PayloadLayout(payload_layout);
        DeviceGuard guard(tx);
        throw_if_error(quantize(tx, meta, Orientation(o), opt, tp, ts, as_stream(stream)));
      },
      "meta"_a, "x"_a, "orientation"_a, "mode"_a, "scale_layout"_a, "payload_layout"_a, "payload"_a, "scales"_a,
      "stream"_a, nb::call_guard<nb::gil_scoped_release>());

  m.def(
      "rmsnorm_quantize",
      [](const View& x, const std::optional<View>& weight, float eps, int mode, const View& payload,
         const View& scales, const std::optional<View>& rstd, uintptr_t stream) {
        const TensorView tx = to_view(x, "x");
        const TensorView tw = weight ? to_view(*weight, "weight") : TensorView{};
        const TensorView tr = rstd ? to_view(*rstd, "rstd") : TensorView{};
        RmsNormQuantizeOptions opt;
        opt.eps = eps;
        opt.mode = ScalingMode(mode);
        DeviceGuard guard(tx);
        throw_if_error(rmsnorm_quantize(tx, tw, opt, to_view(payload, "payload"), to_view(scales, "scales"), tr,
                                        as_stream(stream)));
      },
      "x"_a, "weight"_a.none(), "eps"_a, "mode"_a, "payload"_a, "scales"_a, "rstd"_a.none(), "stream"_a,
      nb::call_guard<nb::gil_scoped_release>());

  m.def(
      "rmsnorm_backward",
      [](const View& x, const std::optional<View>& weight, const View& rstd, const View& dy, const View& dx,
         const std::optional<View>& dweight, uintptr_t stream) {
        const TensorView tx = to_view(x, "x");
        const TensorView tw = weight ? to_view(*weight, "weight") : TensorView{};
        const TensorView tdw = dweight ? to_view(*dweight, "dweight") : TensorView{};
        DeviceGuard guard(tx);
        throw_if_error(rmsnorm_backward(tx, tw, to_view(rstd, "rstd"), to_view(dy, "dy"), to_view(dx, "dx"), tdw,
                                        as_stream(stream)));
      },
      "x"_a, "weight"_a.none(), "rstd"_a, "dy"_a, "dx"_a, "dweight"_a.none(), "stream"_a,
      nb::call_guard<nb::gil_scoped_release>());

  m.def(
      "gemm_quantize",
      [](const View& a, const View& a_scales, const View& w, const View& w_scales, int mode, int path,
         const View& payload, const View& scales, uintptr_t stream) {
        const TensorView ta = to_view(a, "a");
        GemmQuantizeOptions opt;
        opt.mode = ScalingMode(mode);
        opt.path = GemmPath(path);
        DeviceGuard guard(ta);
        throw_if_error(gemm_quantize(ta, to_view(a_scales, "a_scales"), to_view(w, "w"), to_view(w_scales, "w_scales"),
                                     opt, to_view(payload, "payload"), to_view(scales, "scales"), as_stream(stream)));
      },
      "a"_a, "a_scales"_a, "w"_a, "w_scales"_a, "mode"_a, "path"_a, "payload"_a, "scales"_a, "stream"_a,
      nb::call_guard<nb::gil_scoped_release>());

  m.def(
      "quantize_hdim_seq",
      [](const JaggedMeta& meta, const View& x, int mode, int scale_layout, int payload_layout,
         const View& payload_hdim, const View& scales_hdim, const View& payload_seq, const View& scales_seq,
         uintptr_t stream) {
        const TensorView tx = to_view(x, "x");
        const TensorView ph = to_view(payload_hdim, "payload_hdim"), sh = to_view(scales_hdim, "scales_hdim");
        const TensorView ps = to_view(payload_seq, "payload_seq"), ss = to_view(scales_seq, "scales_seq");
        QuantizeOptions opt;
        opt.mode = ScalingMode(mode);
        opt.scale_layout = ScaleLayout(scale_layout);
        opt.payload_layout = PayloadLayout(payload_layout);
        DeviceGuard guard(tx);
        throw_if_error(quantize_hdim_seq(tx, meta, opt, ph, sh, ps, ss, as_stream(stream)));
      },
      "meta"_a, "x"_a, "mode"_a, "scale_layout"_a, "payload_layout"_a, "payload_hdim"_a, "scales_hdim"_a,
      "payload_seq"_a, "scales_seq"_a, "stream"_a, nb::call_guard<nb::gil_scoped_release>());

  m.def(
      "dequantize",
      [](const JaggedMeta& meta, const View& payload, const View& scales, int o, int scale_layout,
         int payload_layout, const View& out, uintptr_t stream) {
        const TensorView tp = to_view(payload, "payload"), ts = to_view(scales, "scales");
        const TensorView to = to_view(out, "out");
        DeviceGuard guard(tp);
        throw_if_error(dequantize(tp, ts, meta, Orientation(o), ScaleLayout(scale_layout),
                                  PayloadLayout(payload_layout), to, as_stream(stream)));
      },
      "meta"_a, "payload"_a, "scales"_a, "orientation"_a, "scale_layout"_a, "payload_layout"_a, "out"_a,
      "stream"_a, nb::call_guard<nb::gil_scoped_release>());

  m.def(
      "to_token_contiguous",
      [](const JaggedMeta& meta, const View& src, const View& dst, uintptr_t stream) {
        const TensorView ts = to_view(src, "src"), td = to_view(dst, "dst");
        DeviceGuard guard(ts);
        throw_if_error(to_token_contiguous(ts, meta, td, as_stream(stream)));
      },
      "meta"_a, "src"_a, "dst"_a, "stream"_a, nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "to_token_major",
      [](const JaggedMeta& meta, const View& src, const View& dst, uintptr_t stream) {
        const TensorView ts = to_view(src, "src"), td = to_view(dst, "dst");
        DeviceGuard guard(ts);
        throw_if_error(to_token_major(ts, meta, td, as_stream(stream)));
      },
      "meta"_a, "src"_a, "dst"_a, "stream"_a, nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "scales_to_blocked",
      [](const JaggedMeta& meta, const View& plain, int64_t heads, int o, const View& blocked, uintptr_t stream) {
        const TensorView tp = to_view(plain, "plain"), tb = to_view(blocked, "blocked");
        DeviceGuard guard(tp);
        throw_if_error(scales_to_blocked(tp, meta, heads, Orientation(o), tb, as_stream(stream)));
      },
      "meta"_a, "plain"_a, "heads"_a, "orientation"_a, "blocked"_a, "stream"_a,
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "scales_to_plain",
      [](const JaggedMeta& meta, const View& blocked, int64_t heads, int o, const View& plain, uintptr_t stream) {
        const TensorView tb = to_view(blocked, "blocked"), tp = to_view(plain, "plain");
        DeviceGuard guard(tb);
        throw_if_error(scales_to_plain(tb, meta, heads, Orientation(o), tp, as_stream(stream)));
      },
      "meta"_a, "blocked"_a, "heads"_a, "orientation"_a, "plain"_a, "stream"_a,
      nb::call_guard<nb::gil_scoped_release>());

  // ------------------------------------------------------------------ attention
  // Every attention entry point (and workspace size) takes the causal mask as a trailing code,
  // `causal` (CAUSAL_MASKS; default 0, none), after the arguments it had before the option existed.
  // Bytes of device workspace attention_forward needs on CUDA tensors (0 in a build without CUDA,
  // and for metadata the launcher would reject, which it reports before looking at the workspace).
  m.def(
      "attention_forward_workspace_size",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads, bool broadcast_q, int causal) -> size_t {
        return attention_forward_workspace_size(q_meta, k_meta, heads, attention_options(NAN, broadcast_q, causal));
      },
      "q_meta"_a, "k_meta"_a, "heads"_a, "broadcast_q"_a, "causal"_a = 0);
  m.def(
      "attention_forward_operands_workspace_size",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads, bool broadcast_q, int causal) -> size_t {
        return attention_forward_operands_workspace_size(q_meta, k_meta, heads,
                                                         attention_options(NAN, broadcast_q, causal));
      },
      "q_meta"_a, "k_meta"_a, "heads"_a, "broadcast_q"_a, "causal"_a = 0);
  m.def(
      "attention_forward",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, const Mx& q, const Mx& k, const Mx& v,
         double softmax_scale, bool broadcast_q, const View& out, const View& lse, uintptr_t workspace,
         size_t workspace_bytes, uintptr_t stream, int causal) {
        const MxTensor tq = to_mx(q, "q"), tk = to_mx(k, "k"), tv = to_mx(v, "v");
        const TensorView to = to_view(out, "out"), tl = to_view(lse, "lse");
        DeviceGuard guard(tq.payload);
        throw_if_error(attention_forward(tq, tk, tv, q_meta, k_meta,
                                         attention_options(softmax_scale, broadcast_q, causal), to, tl,
                                         reinterpret_cast<void*>(workspace), workspace_bytes, as_stream(stream)));
      },
      "q_meta"_a, "k_meta"_a, "q"_a, "k"_a, "v"_a, "softmax_scale"_a, "broadcast_q"_a, "out"_a, "lse"_a,
      "workspace"_a, "workspace_bytes"_a, "stream"_a, "causal"_a = 0, nb::call_guard<nb::gil_scoped_release>());

  // Forward operands in the execution layout (written by quantize_attention_forward, read by the
  // forward without its prepare pass). Shapes as lists in the order q, q_scale, k, k_scale, v, v_scale.
  m.def(
      "attention_fwd_operand_shapes",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads, int64_t kv_heads) {
        if (heads < 1) throw nb::value_error("heads: must be >= 1");
        check_kv_heads(heads, kv_heads);
        const AttentionFwdOperandShapes s = attention_fwd_operand_shapes(q_meta, k_meta, heads, kv_heads);
        using V = std::vector<int64_t>;
        return std::make_tuple(V(s.q, s.q + 3), V(s.q_scale, s.q_scale + 2), V(s.k, s.k + 3),
                               V(s.k_scale, s.k_scale + 2), V(s.v, s.v + 3), V(s.v_scale, s.v_scale + 2));
      },
      "q_meta"_a, "k_meta"_a, "heads"_a, "kv_heads"_a = 0);
  m.def(
      "quantize_attention_forward",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, const View& q, const View& k, const View& v,
         const Ops& ops, uintptr_t stream) {
        const TensorView tq = to_view(q, "q"), tk = to_view(k, "k"), tv = to_view(v, "v");
        const AttentionFwdOperands to = to_ops(ops);
        DeviceGuard guard(tq);
        throw_if_error(quantize_attention_forward(tq, tk, tv, q_meta, k_meta, to, as_stream(stream)));
      },
      "q_meta"_a, "k_meta"_a, "q"_a, "k"_a, "v"_a, "ops"_a, "stream"_a, nb::call_guard<nb::gil_scoped_release>());
  // attention_forward's overload on execution-layout operands (a name of its own: both forms take tuples).
  m.def(
      "attention_forward_operands",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, const Ops& ops, double softmax_scale, bool broadcast_q,
         const View& out, const View& lse, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream,
         int causal) {
        const AttentionFwdOperands to = to_ops(ops);
        const TensorView tout = to_view(out, "out"), tl = to_view(lse, "lse");
        DeviceGuard guard(to.q);
        throw_if_error(attention_forward(to, q_meta, k_meta, attention_options(softmax_scale, broadcast_q, causal),
                                         tout, tl, reinterpret_cast<void*>(workspace), workspace_bytes,
                                         as_stream(stream)));
      },
      "q_meta"_a, "k_meta"_a, "ops"_a, "softmax_scale"_a, "broadcast_q"_a, "out"_a, "lse"_a, "workspace"_a,
      "workspace_bytes"_a, "stream"_a, "causal"_a = 0, nb::call_guard<nb::gil_scoped_release>());

  // Bytes of device workspace the fast CUDA backward needs (0 as for the forward).
  m.def(
      "attention_backward_workspace_size",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads, bool broadcast_q, bool output_mxfp8_dkv,
         int causal) -> size_t {
        const AttentionBackwardOptions opt =
            backward_options(NAN, broadcast_q, 0, 12, 0, output_mxfp8_dkv, false, causal);
        return attention_backward_workspace_size(q_meta, k_meta, heads, opt);
      },
      "q_meta"_a, "k_meta"_a, "heads"_a, "broadcast_q"_a, "output_mxfp8_dkv"_a, "causal"_a = 0);
  // Backward: the kernel options arrive as (dq_accum, dq_fp16_scale_log2, p_scale, output_mxfp8_dkv)
  // codes; the launcher refuses out-of-range and not-yet-implemented values by name.
  m.def(
      "attention_backward",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, const Mx& q, const Mx& q_seq, const Mx& k,
         const Mx& k_seq, const Mx& v, const View& out, const View& dout, const View& lse, double softmax_scale,
         bool broadcast_q, int dq_accum, int dq_fp16_scale_log2, int p_scale, bool output_mxfp8_dkv, bool exact_mx,
         const View& dq, const View& dk, const View& dv, const std::optional<View>& dk_scales,
         const std::optional<View>& dv_scales, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream,
         int causal) {
        const MxTensor tq = to_mx(q, "q"), tqs = to_mx(q_seq, "q_seq"), tk = to_mx(k, "k"),
                       tks = to_mx(k_seq, "k_seq"), tv = to_mx(v, "v");
        const AttentionBackwardOptions opt = backward_options(softmax_scale, broadcast_q, dq_accum, dq_fp16_scale_log2,
                                                              p_scale, output_mxfp8_dkv, exact_mx, causal);
        DeviceGuard guard(tq.payload);
        throw_if_error(attention_backward(tq, tqs, tk, tks, tv, to_view(out, "out"), to_view(dout, "dout"),
                                          to_view(lse, "lse"), q_meta, k_meta, opt, to_view(dq, "dq"),
                                          to_view(dk, "dk"), to_view(dv, "dv"),
                                          dk_scales ? to_view(*dk_scales, "dk_scales") : TensorView{},
                                          dv_scales ? to_view(*dv_scales, "dv_scales") : TensorView{},
                                          reinterpret_cast<void*>(workspace), workspace_bytes, as_stream(stream)));
      },
      "q_meta"_a, "k_meta"_a, "q"_a, "q_seq"_a, "k"_a, "k_seq"_a, "v"_a, "out"_a, "dout"_a, "lse"_a,
      "softmax_scale"_a, "broadcast_q"_a, "dq_accum"_a, "dq_fp16_scale_log2"_a, "p_scale"_a, "output_mxfp8_dkv"_a,
      "exact_mx"_a, "dq"_a, "dk"_a, "dv"_a, "dk_scales"_a.none(), "dv_scales"_a.none(), "workspace"_a,
      "workspace_bytes"_a, "stream"_a, "causal"_a = 0, nb::call_guard<nb::gil_scoped_release>());

  // Backward operands in the execution layout (written by quantize_attention_backward, read by the
  // backward without its prepare passes). Shapes in the order q, q_scale, k, k_scale, v, v_scale, qt,
  // qt_scale, kt, kt_scale.
  m.def(
      "attention_bwd_operand_shapes",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads, int64_t kv_heads) {
        if (heads < 1) throw nb::value_error("heads: must be >= 1");
        check_kv_heads(heads, kv_heads);
        const AttentionBwdOperandShapes s = attention_bwd_operand_shapes(q_meta, k_meta, heads, kv_heads);
        using V = std::vector<int64_t>;
        return std::vector<V>{V(s.q, s.q + 3),   V(s.q_scale, s.q_scale + 2), V(s.k, s.k + 3),
                              V(s.k_scale, s.k_scale + 2), V(s.v, s.v + 3),   V(s.v_scale, s.v_scale + 2),
                              V(s.qt, s.qt + 3), V(s.qt_scale, s.qt_scale + 2), V(s.kt, s.kt + 3),
                              V(s.kt_scale, s.kt_scale + 2)};
      },
      "q_meta"_a, "k_meta"_a, "heads"_a, "kv_heads"_a = 0);
  m.def(
      "quantize_attention_backward",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, const View& q, const View& k, const View& v,
         const BwdOps& ops, bool write_qk, uintptr_t stream) {
        const TensorView tq = to_view(q, "q"), tk = to_view(k, "k"), tv = to_view(v, "v");
        const AttentionBwdOperands to = to_bwd_ops(ops);
        DeviceGuard guard(tq);
        throw_if_error(quantize_attention_backward(tq, tk, tv, q_meta, k_meta, to, as_stream(stream), write_qk));
      },
      "q_meta"_a, "k_meta"_a, "q"_a, "k"_a, "v"_a, "ops"_a, "write_qk"_a, "stream"_a,
      nb::call_guard<nb::gil_scoped_release>());
  // Both operand sets from one read of q, k, v (bwd's q, q_scale, k, k_scale: views of fwd's).
  m.def(
      "quantize_attention_training",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, const View& q, const View& k, const View& v,
         const Ops& fwd, const BwdOps& bwd, uintptr_t stream) {
        const TensorView tq = to_view(q, "q"), tk = to_view(k, "k"), tv = to_view(v, "v");
        const AttentionFwdOperands tf = to_ops(fwd, "fwd");
        const AttentionBwdOperands tb = to_bwd_ops(bwd, "bwd");
        DeviceGuard guard(tq);
        throw_if_error(quantize_attention_training(tq, tk, tv, q_meta, k_meta, tf, tb, as_stream(stream)));
      },
      "q_meta"_a, "k_meta"_a, "q"_a, "k"_a, "v"_a, "fwd"_a, "bwd"_a, "stream"_a,
      nb::call_guard<nb::gil_scoped_release>());
  // quantize_attention_training's overload with MX K and V (hdim, plain, token-major).
  m.def(
      "quantize_attention_training_mx_kv",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, const View& q, const Mx& k, const Mx& v, const Ops& fwd,
         const BwdOps& bwd, uintptr_t stream) {
        const TensorView tq = to_view(q, "q");
        const MxTensor tk = to_mx(k, "k"), tv = to_mx(v, "v");
        const AttentionFwdOperands tf = to_ops(fwd, "fwd");
        const AttentionBwdOperands tb = to_bwd_ops(bwd, "bwd");
        DeviceGuard guard(tq);
        throw_if_error(quantize_attention_training(tq, tk, tv, q_meta, k_meta, tf, tb, as_stream(stream)));
      },
      "q_meta"_a, "k_meta"_a, "q"_a, "k"_a, "v"_a, "fwd"_a, "bwd"_a, "stream"_a,
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "attention_backward_operands_workspace_size",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads, bool broadcast_q, bool output_mxfp8_dkv,
         int causal, int64_t kv_heads) -> size_t {
        const AttentionBackwardOptions opt =
            backward_options(NAN, broadcast_q, 0, 12, 0, output_mxfp8_dkv, false, causal);
        return attention_backward_operands_workspace_size(q_meta, k_meta, heads, opt, kv_heads);
      },
      "q_meta"_a, "k_meta"_a, "heads"_a, "broadcast_q"_a, "output_mxfp8_dkv"_a, "causal"_a = 0, "kv_heads"_a = 0);
  // attention_backward's overload on execution-layout operands.
  m.def(
      "attention_backward_operands",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, const BwdOps& ops, const View& out, const View& dout,
         const View& lse, double softmax_scale, bool broadcast_q, int dq_accum, int dq_fp16_scale_log2, int p_scale,
         bool output_mxfp8_dkv, const View& dq, const View& dk, const View& dv, const std::optional<View>& dk_scales,
         const std::optional<View>& dv_scales, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream,
         int causal) {
        const AttentionBwdOperands to = to_bwd_ops(ops);
        const AttentionBackwardOptions opt = backward_options(softmax_scale, broadcast_q, dq_accum, dq_fp16_scale_log2,
                                                              p_scale, output_mxfp8_dkv, false, causal);
        DeviceGuard guard(to.q);
        throw_if_error(attention_backward(to, to_view(out, "out"), to_view(dout, "dout"), to_view(lse, "lse"), q_meta,
                                          k_meta, opt, to_view(dq, "dq"), to_view(dk, "dk"), to_view(dv, "dv"),
                                          dk_scales ? to_view(*dk_scales, "dk_scales") : TensorView{},
                                          dv_scales ? to_view(*dv_scales, "dv_scales") : TensorView{},
                                          reinterpret_cast<void*>(workspace), workspace_bytes, as_stream(stream)));
      },
      "q_meta"_a, "k_meta"_a, "ops"_a, "out"_a, "dout"_a, "lse"_a, "softmax_scale"_a, "broadcast_q"_a, "dq_accum"_a,
      "dq_fp16_scale_log2"_a, "p_scale"_a, "output_mxfp8_dkv"_a, "dq"_a, "dk"_a, "dv"_a, "dk_scales"_a.none(),
      "dv_scales"_a.none(), "workspace"_a, "workspace_bytes"_a, "stream"_a, "causal"_a = 0,
      nb::call_guard<nb::gil_scoped_release>());

  // mx_attention's step (StepLayout): the buffers' sizes, then the forward (quantize into the
  // buffers, attention on them) and the backward on the saved buffer.
  m.def(
      "attention_step_layout",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads, int64_t kv_heads, bool training,
         bool broadcast_q, int causal, bool cuda) {
        if (heads < 1) throw nb::value_error("heads: must be >= 1");
        check_kv_heads(heads, kv_heads);
        const StepLayout l = step_layout(q_meta, k_meta, heads, kv_heads ? kv_heads : heads, training,
                                         attention_options(NAN, broadcast_q, causal), cuda);
        return std::make_tuple(l.saved, l.scratch);
      },
      "q_meta"_a, "k_meta"_a, "heads"_a, "kv_heads"_a, "training"_a, "broadcast_q"_a, "causal"_a, "cuda"_a);
  m.def(
      "attention_step_forward",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, const View& q, const View& k, const View& v,
         const View& saved, const View& scratch, const View& out, const View& lse, double softmax_scale,
         bool broadcast_q, int causal, bool training, uintptr_t stream) {
        const TensorView tq = to_view(q, "q"), tk = to_view(k, "k"), tv = to_view(v, "v");
        const TensorView ts = to_view(saved, "saved"), tc = to_view(scratch, "scratch");
        const TensorView tout = to_view(out, "out"), tl = to_view(lse, "lse");
        const AttentionOptions opt = attention_options(softmax_scale, broadcast_q, causal);
        const int64_t H = heads_of(tq), hk = heads_of(tk), Hkv = H % hk == 0 ? hk : H;
        DeviceGuard guard(tq);
        const StepLayout l = step_layout(q_meta, k_meta, H, Hkv, training, opt, tq.device == Device::kCUDA);
        uint8_t* sp = step_buffer(ts, "saved", l.saved, tq);
        uint8_t* cp = step_buffer(tc, "scratch", l.scratch, tq);
        AttentionFwdOperands fwd;
        AttentionBwdOperands bwd;
        step_operands(q_meta, k_meta, H, Hkv, l, sp, cp, tq, &fwd, training ? &bwd : nullptr);
        throw_if_error(training ? quantize_attention_training(tq, tk, tv, q_meta, k_meta, fwd, bwd, as_stream(stream))
                                : quantize_attention_forward(tq, tk, tv, q_meta, k_meta, fwd, as_stream(stream)));
        throw_if_error(attention_forward(fwd, q_meta, k_meta, opt, tout, tl, cp + l.workspace_at, l.workspace,
                                         as_stream(stream)));
      },
      "q_meta"_a, "k_meta"_a, "q"_a, "k"_a, "v"_a, "saved"_a, "scratch"_a, "out"_a, "lse"_a, "softmax_scale"_a,
      "broadcast_q"_a, "causal"_a, "training"_a, "stream"_a, nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "attention_step_backward",
      [](const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads, int64_t kv_heads, const View& saved,
         const View& out, const View& dout, const View& lse, double softmax_scale, bool broadcast_q, int causal,
         const View& dq, const View& dk, const View& dv, uintptr_t workspace, size_t workspace_bytes,
         uintptr_t stream) {
        if (heads < 1) throw nb::value_error("heads: must be >= 1");
        check_kv_heads(heads, kv_heads);
        const int64_t Hkv = kv_heads ? kv_heads : heads;
        const TensorView ts = to_view(saved, "saved"), tout = to_view(out, "out");
        const AttentionBackwardOptions opt = backward_options(softmax_scale, broadcast_q, 0, 12, 0, false, false, causal);
        DeviceGuard guard(tout);
        const StepLayout l = step_layout(q_meta, k_meta, heads, Hkv, true, AttentionOptions{}, false);
        AttentionBwdOperands bwd;
        step_operands(q_meta, k_meta, heads, Hkv, l, step_buffer(ts, "saved", l.saved, tout), nullptr, tout, nullptr,
                      &bwd);
        throw_if_error(attention_backward(bwd, tout, to_view(dout, "dout"), to_view(lse, "lse"), q_meta, k_meta, opt,
                                          to_view(dq, "dq"), to_view(dk, "dk"), to_view(dv, "dv"), {}, {},
                                          reinterpret_cast<void*>(workspace), workspace_bytes, as_stream(stream)));
      },
      "q_meta"_a, "k_meta"_a, "heads"_a, "kv_heads"_a, "saved"_a, "out"_a, "dout"_a, "lse"_a, "softmax_scale"_a,
      "broadcast_q"_a, "causal"_a, "dq"_a, "dk"_a, "dv"_a, "workspace"_a, "workspace_bytes"_a, "stream"_a,
      nb::call_guard<nb::gil_scoped_release>());

  // ------------------------------------------------------------------ scalar codecs, vectorized
  m.def(
      "e4m3_encode",
      [](Vec<const float> src, Vec<uint8_t> dst, bool saturate) {
        check_same_size(src.shape(0), dst.shape(0));
        const float* s = src.data();
        uint8_t* d = dst.data();
        nb::gil_scoped_release nogil;
        for (size_t i = 0; i < src.shape(0); ++i) d[i] = float_to_e4m3(s[i], saturate);
      },
      "src"_a, "dst"_a, "saturate"_a);
  m.def(
      "e4m3_decode",
      [](Vec<const uint8_t> src, Vec<float> dst) {
        check_same_size(src.shape(0), dst.shape(0));
        for (size_t i = 0; i < src.shape(0); ++i) dst.data()[i] = e4m3_to_float(src.data()[i]);
      },
      "src"_a, "dst"_a);
  m.def(
      "e8m0_scale",
      [](Vec<const float> amax, Vec<uint8_t> dst, int mode, int zero_byte) {
        check_same_size(amax.shape(0), dst.shape(0));
        if (mode < 0 || mode > 1) throw nb::value_error("mode: must be rceil or floor");
        if (zero_byte < 0 || zero_byte > 255) throw nb::value_error("zero_byte: must be in [0, 255]");
        const float* a = amax.data();
        uint8_t* d = dst.data();
        nb::gil_scoped_release nogil;
        for (size_t i = 0; i < amax.shape(0); ++i) d[i] = e8m0_scale_byte(a[i], ScalingMode(mode), uint8_t(zero_byte));
      },
      "amax"_a, "dst"_a, "mode"_a, "zero_byte"_a);
  m.def(
      "e8m0_decode",
      [](Vec<const uint8_t> src, Vec<float> dst) {
        check_same_size(src.shape(0), dst.shape(0));
        for (size_t i = 0; i < src.shape(0); ++i) dst.data()[i] = e8m0_to_float(src.data()[i]);
      },
      "src"_a, "dst"_a);
}
