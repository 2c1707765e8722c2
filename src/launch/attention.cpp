// Host launchers of MXFP8 attention: validate every argument, then run the exact-MX CPU reference
// (CPU tensors) or the sm_90a kernels (CUDA tensors). The causal mask (opt.causal) reaches every
// path: the CUDA problems, the CPU reference's problems and the workspace sizes.
#include "mxflash/attention.h"

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/attention/attention_bwd.h"
#include "cuda/attention/attention_fwd.h"
#include "launch/device_runtime.h"
#include "mxflash/quantize.h"
#include "reference/attention_ref.h"

namespace mxflash {
namespace {

float resolved_scale(float softmax_scale) {
  return std::isnan(softmax_scale) ? float(1.0 / std::sqrt(double(kHeadDim))) : softmax_scale;
}

std::string with(const char* op, const char* field) { return std::string(op) + "." + field; }

// One MX operand: orientation, dtypes, shapes, contiguity for its metadata and head count.
Status check_operand(const MxTensor& t, const char* name, Orientation want, const JaggedMeta& meta, int64_t* heads) {
  if (int(t.orientation) < 0 || int(t.orientation) > 2)
    return Status::Invalid(with(name, "orientation") + ": must be " + to_string(want) + ", got an unknown value " +
                           std::to_string(int(t.orientation)));
  if (t.orientation != want)
    return Status::Invalid(with(name, "orientation") + ": must be " + to_string(want) + ", got " +
                           to_string(t.orientation));
  if (int(t.scale_layout) < 0 || int(t.scale_layout) > 1)
    return Status::Invalid(with(name, "scale_layout") + ": must be plain or blocked128x4");
  if (int(t.payload_layout) < 0 || int(t.payload_layout) > 1)
    return Status::Invalid(with(name, "payload_layout") + ": must be token_major or token_contiguous");
  if (want == Orientation::kHdim && t.payload_layout != PayloadLayout::kTokenMajor)
    return Status::Invalid(with(name, "payload_layout") + ": hdim payloads are token_major only");
  const std::string pn = with(name, "payload"), sn = with(name, "scales");
  MXFLASH_RETURN_IF_ERROR(check_dtype(t.payload, pn.c_str(), {DType::kE4M3, DType::kUInt8}));
  MXFLASH_RETURN_IF_ERROR(check_dtype(t.scales, sn.c_str(), {DType::kE8M0, DType::kUInt8}));
  if (t.payload.ndim != 3) return Status::Invalid(pn + ": must be 3-D, got " + t.payload.shape_string());
  const int64_t H = t.payload_layout == PayloadLayout::kTokenMajor ? t.payload.shape[1] : t.payload.shape[0];
  if (H < 1) return Status::Invalid(pn + ": head count must be >= 1");
  if (*heads == 0) *heads = H;
  if (H != *heads)
    return Status::Invalid(pn + ": has " + std::to_string(H) + " heads, q has " + std::to_string(*heads));
  int64_t shape[3];
  payload_shape(meta, H, t.payload_layout, shape);
  MXFLASH_RETURN_IF_ERROR(check_shape(t.payload, pn.c_str(), 3, shape));
  const ScaleShape ss = scale_shape(meta, H, t.orientation, t.scale_layout);
  MXFLASH_RETURN_IF_ERROR(check_shape(t.scales, sn.c_str(), ss.ndim, ss.dims));
  for (const auto* v : {&t.payload, &t.scales}) {
    const std::string n = v == &t.payload ? pn : sn;
    MXFLASH_RETURN_IF_ERROR(check_contiguous(*v, n.c_str()));
    MXFLASH_RETURN_IF_ERROR(check_not_null(*v, n.c_str()));
  }
  // TMA and 16-byte vector loads read the payloads.
  MXFLASH_RETURN_IF_ERROR(check_alignment(t.payload, pn.c_str(), 16));
  return Status::Ok();
}

Status check_metas(const JaggedMeta& q_meta, const JaggedMeta& k_meta, bool broadcast_q) {
  if (q_meta.batch() < 1) return Status::Invalid("q_meta: empty metadata");
  if (k_meta.batch() < 1) return Status::Invalid("k_meta: empty metadata");
  if (broadcast_q && q_meta.batch() != 1)
    return Status::Invalid("q_meta: broadcast_q needs exactly one Q sequence, got " + std::to_string(q_meta.batch()));
  if (!broadcast_q && q_meta.batch() != k_meta.batch())
    return Status::Invalid("q_meta: has " + std::to_string(q_meta.batch()) + " sequences but k_meta has " +
                           std::to_string(k_meta.batch()) + " (use broadcast_q for one shared Q sequence)");
  return Status::Ok();
}

Status check_scale(float scale) {
  if (!(scale > 0.f) || std::isinf(scale)) return Status::Invalid("softmax_scale: must be a finite positive number");
  return Status::Ok();
}

// The dequantized values of an MX operand, (T, H, 128) fp32.
Status dequantized(const MxTensor& t, const JaggedMeta& m, int64_t H, std::vector<float>* x) {
  x->assign(size_t(m.total_tokens() * H * kHeadDim), 0.f);
  return dequantize(t.payload, t.scales, m, t.orientation, t.scale_layout, t.payload_layout,
                    make_view(x->data(), DType::kFloat32, Device::kCPU, {m.total_tokens(), H, kHeadDim}));
}

cuda::MxOperand device_operand(const MxTensor& t) {
  return {t.payload.ptr<const uint8_t>(), t.scales.ptr<const uint8_t>(), t.scale_layout, t.payload_layout};
}

// The fields the forward and backward CUDA problems share: shapes, options (the quantizers, which
// know no mask, pass CausalMask::kNone), device and host metadata.
template <typename Problem>
void fill_problem(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t H, int64_t To, bool broadcast_q,
                  float scale, CausalMask causal, Problem* p) {
  p->batch = k_meta.batch();
  p->heads = int(H);
  p->Pq = q_meta.padded_tokens();
  p->Pk = k_meta.padded_tokens();
  p->To = To;
  p->broadcast_q = broadcast_q;
  p->softmax_scale = scale;
  p->causal = causal;
  p->cu_q = q_meta.device_cu_seqlens();
  p->cu_q_sf = q_meta.device_cu_seqlens_sf();
  p->cu_k = k_meta.device_cu_seqlens();
  p->cu_k_sf = k_meta.device_cu_seqlens_sf();
  p->host_cu_q = &q_meta.cu_seqlens();
  p->host_cu_k = &k_meta.cu_seqlens();
}

int64_t out_tokens(const JaggedMeta& q_meta, const JaggedMeta& k_meta, bool broadcast_q) {
  return broadcast_q ? int64_t(k_meta.batch()) * q_meta.total_tokens() : q_meta.total_tokens();
}

// A forward's outputs: out (To, H, 128) bf16 (4-byte aligned: bf16 pairs are stored), lse (H, To).
Status check_forward_outputs(const TensorView& out, const TensorView& lse, int64_t To, int64_t H) {
  const int64_t out_shape[3] = {To, H, kHeadDim}, lse_shape[2] = {H, To};
  MXFLASH_RETURN_IF_ERROR(check_dense(out, "out", {DType::kBFloat16}, 3, out_shape));
  MXFLASH_RETURN_IF_ERROR(check_alignment(out, "out", 4));
  return check_dense(lse, "lse", {DType::kFloat32}, 2, lse_shape);
}

// Before CUDA work: the device `name` lives on is usable, and both metadata have device copies.
Status check_cuda_call(int device_id, const char* name, const JaggedMeta& q_meta, const JaggedMeta& k_meta) {
  MXFLASH_RETURN_IF_ERROR(detail::check_cuda_ready(device_id, name));
  if (!q_meta.on_device()) return Status::Invalid("q_meta: has no device copy; call q_meta.upload() first");
  if (!k_meta.on_device()) return Status::Invalid("k_meta: has no device copy; call k_meta.upload() first");
  return Status::Ok();
}

// TMA tile coordinates are 32-bit: rows of the (H, P, 128) Q' and K' and of V' (H*128, P).
Status check_tma_coordinates(const char* name, int64_t H, const JaggedMeta& q_meta, const JaggedMeta& k_meta) {
  constexpr int64_t kMaxCoord = (int64_t(1) << 31) - 1;
  if (H * q_meta.padded_tokens() > kMaxCoord || H * k_meta.padded_tokens() > kMaxCoord)
    return Status::Unsupported(std::string(name) + ": heads x 128-padded tokens must stay below 2^31 for the fast " +
                               "kernel (got " + std::to_string(H) + " x " +
                               std::to_string(std::max(q_meta.padded_tokens(), k_meta.padded_tokens())) + ")");
  return Status::Ok();
}

// CPU: dequantize the operands (exact) and run the exact-MX reference, whose quantizers return
// already-representable MX values unchanged.
Status forward_cpu_values(const std::vector<float>& qf, const std::vector<float>& kf, const std::vector<float>& vf,
                          const JaggedMeta& qm, const JaggedMeta& km, int64_t H, float scale, bool broadcast_q,
                          CausalMask causal, TensorView out, TensorView lse) {
  const ref::AttnProblem p = ref::make_problem(qm, km, H, qf.data(), kf.data(), vf.data(), scale, broadcast_q, causal);
  ref::AttnForwardResult r;
  MXFLASH_RETURN_IF_ERROR(ref::attention_forward(p, ref::AttnMethod::kMx, &r));
  uint16_t* o = out.ptr<uint16_t>();
  for (size_t i = 0; i < r.out.size(); ++i) o[i] = float_to_bf16(float(r.out[i]));
  float* l = lse.ptr<float>();
  for (size_t i = 0; i < r.lse.size(); ++i) l[i] = float(r.lse[i]);
  return Status::Ok();
}
Status forward_cpu(const MxTensor& q, const MxTensor& k, const MxTensor& v, const JaggedMeta& qm, const JaggedMeta& km,
                   int64_t H, float scale, bool broadcast_q, CausalMask causal, TensorView out, TensorView lse) {
  std::vector<float> qf, kf, vf;
  MXFLASH_RETURN_IF_ERROR(dequantized(q, qm, H, &qf));
  MXFLASH_RETURN_IF_ERROR(dequantized(k, km, H, &kf));
  MXFLASH_RETURN_IF_ERROR(dequantized(v, km, H, &vf));
  return forward_cpu_values(qf, kf, vf, qm, km, H, scale, broadcast_q, causal, out, lse);
}

// The workspace-size queries answer 0 for metadata (or a causal value) the calls would reject (and
// then read nothing past q's cu_seqlens).
bool sizable(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads, bool broadcast_q, CausalMask causal) {
  if (q_meta.batch() < 1 || k_meta.batch() < 1 || heads < 1 || !ref::check_causal(causal).ok()) return false;
  return broadcast_q ? q_meta.batch() == 1 : q_meta.batch() == k_meta.batch();
}

}  // namespace

const char* causal_name(CausalMask mask) {
  switch (mask) {
    case CausalMask::kNone: return "none";
    case CausalMask::kTopLeft: return "top_left";
    case CausalMask::kBottomRight: return "bottom_right";
  }
  return "?";
}

bool parse_causal(const std::string& text, CausalMask* out) {
  for (CausalMask m : {CausalMask::kNone, CausalMask::kTopLeft, CausalMask::kBottomRight}) {
    std::string hyphen = causal_name(m);
    for (char& c : hyphen) c = c == '_' ? '-' : c;
    if (text == causal_name(m) || text == hyphen) {
      *out = m;
      return true;
    }
  }
  return false;
}

size_t attention_forward_workspace_size(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                        const AttentionOptions& opt) {
  if (!sizable(q_meta, k_meta, heads, opt.broadcast_q, opt.causal)) return 0;
  return cuda::attention_fwd_workspace_bytes(q_meta.cu_seqlens(), k_meta.cu_seqlens(), k_meta.batch(), heads,
                                             q_meta.padded_tokens(), k_meta.padded_tokens(), opt.broadcast_q,
                                             opt.causal);
}

Status attention_forward(const MxTensor& q, const MxTensor& k, const MxTensor& v, const JaggedMeta& q_meta,
                         const JaggedMeta& k_meta, const AttentionOptions& opt, TensorView out, TensorView lse,
                         void* workspace, size_t workspace_bytes, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_metas(q_meta, k_meta, opt.broadcast_q));
  const float scale = resolved_scale(opt.softmax_scale);
  MXFLASH_RETURN_IF_ERROR(check_scale(scale));
  MXFLASH_RETURN_IF_ERROR(ref::check_causal(opt.causal));
  int64_t H = 0;
  MXFLASH_RETURN_IF_ERROR(check_operand(q, "q", Orientation::kHdim, q_meta, &H));
  MXFLASH_RETURN_IF_ERROR(check_operand(k, "k", Orientation::kHdim, k_meta, &H));
  MXFLASH_RETURN_IF_ERROR(check_operand(v, "v", Orientation::kSeq, k_meta, &H));
  const int64_t To = out_tokens(q_meta, k_meta, opt.broadcast_q);
  MXFLASH_RETURN_IF_ERROR(check_forward_outputs(out, lse, To, H));
  Device dev = Device::kCPU;
  MXFLASH_RETURN_IF_ERROR(check_same_device({{&q.payload, "q.payload"},
                                             {&q.scales, "q.scales"},
                                             {&k.payload, "k.payload"},
                                             {&k.scales, "k.scales"},
                                             {&v.payload, "v.payload"},
                                             {&v.scales, "v.scales"},
                                             {&out, "out"},
                                             {&lse, "lse"}},
                                            &dev));
  if (To == 0) return Status::Ok();
  if (dev == Device::kCPU)
    return forward_cpu(q, k, v, q_meta, k_meta, H, scale, opt.broadcast_q, opt.causal, out, lse);
  MXFLASH_RETURN_IF_ERROR(check_cuda_call(q.payload.device_id, "q.payload", q_meta, k_meta));
  if (!opt.exact_mx) MXFLASH_RETURN_IF_ERROR(check_tma_coordinates("q.payload", H, q_meta, k_meta));
  if (workspace && workspace_bytes < attention_forward_workspace_size(q_meta, k_meta, H, opt))
    return Status::Invalid("workspace: smaller than attention_forward_workspace_size()");
  cuda::AttentionFwdProblem p;
  fill_problem(q_meta, k_meta, H, To, opt.broadcast_q, scale, opt.causal, &p);
  p.q = device_operand(q);
  p.k = device_operand(k);
  p.v = device_operand(v);
  p.out = out.data;
  p.lse = lse.ptr<float>();
  if (opt.exact_mx) return cuda::attention_forward_exact(p, stream);
  return cuda::attention_forward(p, workspace, workspace_bytes, stream);
}

// ------------------------------------------------------ forward operands in the execution layout
namespace {

constexpr int64_t kTileTokens = 128;

// K and V's head count for a `kv_heads` argument (0: heads).
int64_t kv_or(int64_t heads, int64_t kv_heads) { return kv_heads > 0 ? kv_heads : heads; }

// Grouped-query attention's rule: K and V (named kname) have H heads or a divisor of H (qname's).
Status check_kv_heads(int64_t H, int64_t Hkv, const std::string& kname, const std::string& qname) {
  if (Hkv >= 1 && H % Hkv == 0) return Status::Ok();
  return Status::Invalid(kname + ": has " + std::to_string(Hkv) + " heads, which must divide " + qname + "'s " +
                         std::to_string(H) + " (the same count, or a grouped-query share of it)");
}

// The head counts of an execution-layout operand set (named `set` in messages): Q's from its
// q (H, Pq, 128), K and V's from its k (Hkv, Pk, 128).
Status operand_heads(const TensorView& q, const TensorView& k, const std::string& set, int64_t* heads,
                     int64_t* kv_heads) {
  if (q.ndim != 3) return Status::Invalid(set + ".q: must be 3-D (H, Pq, 128), got " + q.shape_string());
  *heads = q.shape[0];
  if (*heads < 1) return Status::Invalid(set + ".q: head count must be >= 1");
  if (k.ndim != 3) return Status::Invalid(set + ".k: must be 3-D (Hkv, Pk, 128), got " + k.shape_string());
  *kv_heads = k.shape[0];
  return check_kv_heads(*heads, *kv_heads, set + ".k", set + ".q");
}

// x (T, Hkv, 128) with each head repeated `group` times: (T, Hkv x group, 128), head h = x's h / group.
template <typename T>
std::vector<T> repeat_heads(const std::vector<T>& x, int64_t Hkv, int64_t group) {
  if (group == 1) return x;
  const size_t rows = x.size() / size_t(Hkv * kHeadDim);
  std::vector<T> y(x.size() * size_t(group));
  for (size_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < Hkv * group; ++h)
      std::copy_n(x.begin() + ptrdiff_t((t * size_t(Hkv) + size_t(h / group)) * kHeadDim), kHeadDim,
                  y.begin() + ptrdiff_t((t * size_t(Hkv * group) + size_t(h)) * kHeadDim));
  return y;
}

// One tensor of an execution-layout operand set: an e4m3 payload (3-D) or fp32 scales (2-D), its
// name and its shape for the metadata. View: TensorView, const for a set that is only read.
template <typename View>
struct OperandSlot {
  View* t;
  const char* name;
  bool payload;
  const int64_t* shape;
};

// The forward's and the backward's operand sets as tables of slots, in their public order (the
// order of attention_*_operand_bytes / _views and of their `data` arrays).
template <typename Ops>  // AttentionFwdOperands, const or not
auto operand_table(Ops& o, const AttentionFwdOperandShapes& sh) {
  using View = std::remove_reference_t<decltype((o.q))>;  // const TensorView for const Ops
  return std::array<OperandSlot<View>, kAttentionFwdOperandCount>{{{&o.q, "q", true, sh.q},
                                                                   {&o.k, "k", true, sh.k},
                                                                   {&o.v, "v", true, sh.v},
                                                                   {&o.q_scale, "q_scale", false, sh.q_scale},
                                                                   {&o.k_scale, "k_scale", false, sh.k_scale},
                                                                   {&o.v_scale, "v_scale", false, sh.v_scale}}};
}
template <typename Ops>  // AttentionBwdOperands, const or not
auto operand_table(Ops& o, const AttentionBwdOperandShapes& sh) {
  using View = std::remove_reference_t<decltype((o.q))>;  // const TensorView for const Ops
  return std::array<OperandSlot<View>, kAttentionBwdOperandCount>{{{&o.q, "q", true, sh.q},
                                                                   {&o.k, "k", true, sh.k},
                                                                   {&o.v, "v", true, sh.v},
                                                                   {&o.qt, "qt", true, sh.qt},
                                                                   {&o.kt, "kt", true, sh.kt},
                                                                   {&o.q_scale, "q_scale", false, sh.q_scale},
                                                                   {&o.k_scale, "k_scale", false, sh.k_scale},
                                                                   {&o.v_scale, "v_scale", false, sh.v_scale},
                                                                   {&o.qt_scale, "qt_scale", false, sh.qt_scale},
                                                                   {&o.kt_scale, "kt_scale", false, sh.kt_scale}}};
}

// Views of an operand set over `data` (e4m3 payloads, fp32 scales) on `device`.
template <typename Ops, typename Shapes>
Ops operand_views(const Shapes& sh, void* const* data, Device device, int device_id) {
  Ops o;
  const auto table = operand_table(o, sh);
  for (size_t i = 0; i < table.size(); ++i) {
    const auto& slot = table[i];
    *slot.t = make_view(data[i], slot.payload ? DType::kE4M3 : DType::kFloat32, device, slot.payload ? 3 : 2,
                        slot.shape, device_id);
  }
  return o;
}

// The byte sizes of an operand set's parts, in the table's order.
template <typename Ops, typename Shapes>
void operand_bytes(const Shapes& sh, size_t* bytes) {
  Ops o;
  const auto table = operand_table(o, sh);
  void* none[std::tuple_size_v<decltype(table)>] = {};
  o = operand_views<Ops>(sh, none, Device::kCPU, 0);
  for (size_t i = 0; i < table.size(); ++i) bytes[i] = size_t(table[i].t->nbytes());
}

// An operand set's checks, named `set`.name in messages: dtypes, shapes for the metadata,
// contiguity, non-null data, alignment (TMA reads the payloads in 16-byte units), every part on
// q's device (*dev). Each payload is checked with its scales next (q, q_scale, k, k_scale, ...: the
// tables list the payloads first), so a wrong head count in q is reported at q_scale.
template <typename Table>
Status check_operand_parts(const Table& parts, const std::string& set, Device* dev) {
  constexpr size_t kPayloads = std::tuple_size_v<Table> / 2;
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& p = parts[i % 2 == 0 ? i / 2 : kPayloads + i / 2];
    const std::string name = set + "." + p.name;
    if (p.payload)
      MXFLASH_RETURN_IF_ERROR(check_dense(*p.t, name.c_str(), {DType::kE4M3, DType::kUInt8}, 3, p.shape));
    else
      MXFLASH_RETURN_IF_ERROR(check_dense(*p.t, name.c_str(), {DType::kFloat32}, 2, p.shape));
    MXFLASH_RETURN_IF_ERROR(check_alignment(*p.t, name.c_str(), p.payload ? 16 : 4));
  }
  const std::string first = set + "." + parts[0].name;
  for (const auto& p : parts) {
    const std::string name = set + "." + p.name;
    MXFLASH_RETURN_IF_ERROR(check_same_device({{parts[0].t, first.c_str()}, {p.t, name.c_str()}}, dev));
  }
  return Status::Ok();
}

// The forward operands' checks (check_operand_parts), named `set`.name in messages. Heads from q,
// K and V's from k.
Status check_operands(const AttentionFwdOperands& ops, const JaggedMeta& q_meta, const JaggedMeta& k_meta,
                      int64_t* heads, int64_t* kv_heads, Device* dev, const std::string& set = "ops") {
  MXFLASH_RETURN_IF_ERROR(operand_heads(ops.q, ops.k, set, heads, kv_heads));
  const AttentionFwdOperandShapes sh = attention_fwd_operand_shapes(q_meta, k_meta, *heads, *kv_heads);
  return check_operand_parts(operand_table(ops, sh), set, dev);
}

cuda::FwdExecOperands exec_operands(const AttentionFwdOperands& ops) {
  return {static_cast<uint8_t*>(ops.q.data),       static_cast<uint8_t*>(ops.k.data),
          static_cast<uint8_t*>(ops.v.data),       static_cast<float*>(ops.q_scale.data),
          static_cast<float*>(ops.k_scale.data),   static_cast<float*>(ops.v_scale.data),
          /*v_per_tile=*/true};
}

// The quantizers' q (Tq, H, 128), bf16 or fp32, contiguous, 16-byte aligned; metadata with one Q
// sequence or one per K/V sequence. *heads from q.
Status check_quantize_q(const TensorView& q, const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t* heads) {
  if (q_meta.batch() < 1) return Status::Invalid("q_meta: empty metadata");
  if (k_meta.batch() < 1) return Status::Invalid("k_meta: empty metadata");
  // Q is quantized over its own sequences: one shared sequence (broadcast_q), or one per K/V sequence.
  if (q_meta.batch() != 1 && q_meta.batch() != k_meta.batch())
    return Status::Invalid("q_meta: has " + std::to_string(q_meta.batch()) + " sequences but k_meta has " +
                           std::to_string(k_meta.batch()) + " (only one shared Q sequence may differ)");
  if (q.ndim != 3) return Status::Invalid("q: must be 3-D (Tq, H, 128), got " + q.shape_string());
  const int64_t qs[3] = {q_meta.total_tokens(), q.shape[1], kHeadDim};
  MXFLASH_RETURN_IF_ERROR(check_dense(q, "q", {DType::kBFloat16, DType::kFloat32}, 3, qs));
  *heads = q.shape[1];
  return check_alignment(q, "q", 16);
}

// The quantizers' inputs: q as check_quantize_q takes it, k and v (Tk, Hkv, 128) of q's dtype,
// contiguous, 16-byte aligned, Hkv = H or a divisor of it (grouped-query attention). *heads from q,
// *kv_heads from k.
Status check_quantize_inputs(const TensorView& q, const TensorView& k, const TensorView& v, const JaggedMeta& q_meta,
                             const JaggedMeta& k_meta, int64_t* heads, int64_t* kv_heads) {
  int64_t H = 0;
  MXFLASH_RETURN_IF_ERROR(check_quantize_q(q, q_meta, k_meta, &H));
  const int64_t Hkv = k.ndim == 3 ? k.shape[1] : H;
  if (k.ndim == 3) MXFLASH_RETURN_IF_ERROR(check_kv_heads(H, Hkv, "k", "q"));
  const int64_t ks[3] = {k_meta.total_tokens(), Hkv, kHeadDim};
  MXFLASH_RETURN_IF_ERROR(check_dense(k, "k", {q.dtype}, 3, ks));
  MXFLASH_RETURN_IF_ERROR(check_dense(v, "v", {q.dtype}, 3, ks));
  for (const auto& [t, n] : {std::pair{&k, "k"}, std::pair{&v, "v"}})
    MXFLASH_RETURN_IF_ERROR(check_alignment(*t, n, 16));  // (check_dense checked non-null data)
  *heads = H;
  *kv_heads = Hkv;
  return Status::Ok();
}

// The quantizers' rule that an operand set (named `set`) has the inputs' head counts H and Hkv.
Status check_operand_heads(int64_t heads, int64_t kv_heads, int64_t H, int64_t Hkv, const char* set) {
  if (heads != H)
    return Status::Invalid(std::string(set) + ".q: has " + std::to_string(heads) + " heads, q has " + std::to_string(H));
  if (kv_heads != Hkv)
    return Status::Invalid(std::string(set) + ".k: has " + std::to_string(kv_heads) + " heads, k has " +
                           std::to_string(Hkv));
  return Status::Ok();
}

// A CPU reference output (a vector of bytes or floats) into the CPU view that receives it.
template <typename Vec>
void copy_into(const Vec& src, const TensorView& dst) {
  std::copy(src.begin(), src.end(), static_cast<typename Vec::value_type*>(dst.data));
}

// A CPU bf16 or fp32 tensor's values.
std::vector<float> as_f32(const TensorView& x) {
  std::vector<float> f(size_t(x.numel()));
  for (size_t i = 0; i < f.size(); ++i)
    f[i] = x.dtype == DType::kFloat32 ? x.ptr<const float>()[i] : bf16_to_float(x.ptr<const uint16_t>()[i]);
  return f;
}

// The values of CPU operands, (T, H, 128) fp32 (exact: e4m3 times a power of two). A rows operand
// (H, P, 128), its scale per row (per_row) or per 128-token tile (H, P / 128):
void rows_values(const TensorView& x, const TensorView& sc, const JaggedMeta& m, int64_t H, bool per_row,
                 std::vector<float>* out) {
  const int64_t P = m.padded_tokens();
  const uint8_t* x8 = x.ptr<const uint8_t>();
  const float* s = sc.ptr<const float>();
  out->assign(size_t(m.total_tokens() * H * kHeadDim), 0.f);
  for (int b = 0; b < m.batch(); ++b)
    for (int64_t t = m.cu_seqlens()[b]; t < m.cu_seqlens()[b + 1]; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = h * P + m.cu_seqlens_sf()[b] + t - m.cu_seqlens()[b];
        const float f = per_row ? s[row] : s[h * (P / kTileTokens) + (row - h * P) / kTileTokens];
        for (int d = 0; d < kHeadDim; ++d)
          (*out)[size_t((t * H + h) * kHeadDim + d)] = e4m3_to_float(x8[row * kHeadDim + d]) * f;
      }
}
// A token-contiguous operand (H, 128, P) whose 32-token groups are in the kernels' fragment order,
// its scale per 128-token tile (H, P / 128).
void tokens_values(const TensorView& x, const TensorView& sc, const JaggedMeta& m, int64_t H, std::vector<float>* out) {
  // Position of token i of a 32-group: the inverse of the fragment order, derived here on its own
  // (not from ref::attention_fwd_operands' copy), so a CPU round trip through the operands checks it.
  int at_pos[32];
  for (int pos = 0; pos < 32; ++pos) {
    const int i = 16 * (pos / 16) + 2 * ((pos % 16) / 4) + 8 * ((pos % 4) / 2) + pos % 2;
    at_pos[i] = pos;
  }
  const int64_t P = m.padded_tokens();
  const uint8_t* x8 = x.ptr<const uint8_t>();
  const float* s = sc.ptr<const float>();
  out->assign(size_t(m.total_tokens() * H * kHeadDim), 0.f);
  for (int b = 0; b < m.batch(); ++b)
    for (int64_t t = m.cu_seqlens()[b]; t < m.cu_seqlens()[b + 1]; ++t) {
      const int64_t tp = m.cu_seqlens_sf()[b] + t - m.cu_seqlens()[b], tile = tp / kTileTokens;
      const int64_t col = tile * kTileTokens + 32 * ((tp % kTileTokens) / 32) + at_pos[tp % 32];
      for (int64_t h = 0; h < H; ++h)
        for (int d = 0; d < kHeadDim; ++d)
          (*out)[size_t((t * H + h) * kHeadDim + d)] =
              e4m3_to_float(x8[(h * kHeadDim + d) * P + col]) * s[h * (P / kTileTokens) + tile];
    }
}

// The forward's operands on the CPU (ref::attention_fwd_operands) of q (Tq, H, 128), k and v
// (Tk, Hkv, 128): one call, or with fewer K/V heads (grouped-query attention) Q' from Q's own call and
// K', V' from K/V's (each output depends on its own input only).
Status fwd_operands_cpu(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t H, int64_t Hkv,
                        const std::vector<float>& qf, const std::vector<float>& kf, const std::vector<float>& vf,
                        ref::AttnFwdOperands* r) {
  if (Hkv == H) return ref::attention_fwd_operands(q_meta, k_meta, H, qf.data(), kf.data(), vf.data(), r);
  ref::AttnFwdOperands kv;
  MXFLASH_RETURN_IF_ERROR(ref::attention_fwd_operands(q_meta, q_meta, H, qf.data(), qf.data(), qf.data(), r));
  MXFLASH_RETURN_IF_ERROR(ref::attention_fwd_operands(k_meta, k_meta, Hkv, kf.data(), kf.data(), vf.data(), &kv));
  r->k = std::move(kv.k), r->k_scale = std::move(kv.k_scale);
  r->v = std::move(kv.v), r->v_scale = std::move(kv.v_scale);
  return Status::Ok();
}

// The operands' values, K and V repeated to H heads.
void dequantized_operands(const AttentionFwdOperands& ops, const JaggedMeta& qm, const JaggedMeta& km, int64_t H,
                          int64_t Hkv, std::vector<float>* q, std::vector<float>* k, std::vector<float>* v) {
  rows_values(ops.q, ops.q_scale, qm, H, true, q);
  rows_values(ops.k, ops.k_scale, km, Hkv, false, k);
  tokens_values(ops.v, ops.v_scale, km, Hkv, v);
  *k = repeat_heads(*k, Hkv, H / Hkv);
  *v = repeat_heads(*v, Hkv, H / Hkv);
}

}  // namespace

AttentionFwdOperandShapes attention_fwd_operand_shapes(const JaggedMeta& q_meta, const JaggedMeta& k_meta,
                                                       int64_t heads, int64_t kv_heads) {
  const int64_t kvh = kv_or(heads, kv_heads);
  const int64_t Pq = q_meta.padded_tokens(), Pk = k_meta.padded_tokens();
  return {{heads, Pq, kHeadDim}, {heads, Pq}, {kvh, Pk, kHeadDim}, {kvh, Pk / kTileTokens},
          {kvh, kHeadDim, Pk}, {kvh, Pk / kTileTokens}};
}

void attention_fwd_operand_bytes(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                 size_t bytes[kAttentionFwdOperandCount], int64_t kv_heads) {
  operand_bytes<AttentionFwdOperands>(attention_fwd_operand_shapes(q_meta, k_meta, heads, kv_heads), bytes);
}

AttentionFwdOperands attention_fwd_operand_views(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                                 void* const data[kAttentionFwdOperandCount], Device device,
                                                 int device_id, int64_t kv_heads) {
  return operand_views<AttentionFwdOperands>(attention_fwd_operand_shapes(q_meta, k_meta, heads, kv_heads), data,
                                             device, device_id);
}

size_t attention_forward_operands_workspace_size(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                                 const AttentionOptions& opt) {
  if (!sizable(q_meta, k_meta, heads, opt.broadcast_q, opt.causal)) return 0;
  return cuda::attention_fwd_exec_workspace_bytes(q_meta.cu_seqlens(), k_meta.cu_seqlens(), k_meta.batch(), heads,
                                                  opt.broadcast_q, opt.causal);
}

Status quantize_attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const JaggedMeta& q_meta, const JaggedMeta& k_meta, const AttentionFwdOperands& ops,
                                  void* stream) {
  int64_t H = 0, Hkv = 0;
  MXFLASH_RETURN_IF_ERROR(check_quantize_inputs(q, k, v, q_meta, k_meta, &H, &Hkv));
  int64_t oh = 0, okv = 0;
  Device od = Device::kCPU, xd = Device::kCPU;
  MXFLASH_RETURN_IF_ERROR(check_operands(ops, q_meta, k_meta, &oh, &okv, &od));
  MXFLASH_RETURN_IF_ERROR(check_operand_heads(oh, okv, H, Hkv, "ops"));
  MXFLASH_RETURN_IF_ERROR(check_same_device({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&ops.q, "ops.q"}}, &xd));
  if (xd == Device::kCPU) {
    ref::AttnFwdOperands r;
    MXFLASH_RETURN_IF_ERROR(fwd_operands_cpu(q_meta, k_meta, H, Hkv, as_f32(q), as_f32(k), as_f32(v), &r));
    copy_into(r.q, ops.q);
    copy_into(r.k, ops.k);
    copy_into(r.v, ops.v);
    copy_into(r.q_scale, ops.q_scale);
    copy_into(r.k_scale, ops.k_scale);
    copy_into(r.v_scale, ops.v_scale);
    return Status::Ok();
  }
  MXFLASH_RETURN_IF_ERROR(check_cuda_call(q.device_id, "q", q_meta, k_meta));
  cuda::AttentionFwdProblem p;
  fill_problem(q_meta, k_meta, H, q_meta.total_tokens(), false, 1.f, CausalMask::kNone, &p);
  p.kv_heads = int(Hkv);
  // The kernels take Q's sequence count from p.broadcast_q (1) or p.batch.
  p.broadcast_q = q_meta.batch() != k_meta.batch();
  return cuda::quantize_attention_fwd_operands(p, q.data, k.data, v.data, q.dtype == DType::kFloat32,
                                               exec_operands(ops), stream);
}

Status attention_forward(const AttentionFwdOperands& ops, const JaggedMeta& q_meta, const JaggedMeta& k_meta,
                         const AttentionOptions& opt, TensorView out, TensorView lse, void* workspace,
                         size_t workspace_bytes, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_metas(q_meta, k_meta, opt.broadcast_q));
  const float scale = resolved_scale(opt.softmax_scale);
  MXFLASH_RETURN_IF_ERROR(check_scale(scale));
  MXFLASH_RETURN_IF_ERROR(ref::check_causal(opt.causal));
  if (opt.exact_mx)
    return Status::Unsupported("opt.exact_mx: the exact-MX path takes MX tensors, not execution-layout operands");
  int64_t H = 0, Hkv = 0;
  Device dev = Device::kCPU;
  MXFLASH_RETURN_IF_ERROR(check_operands(ops, q_meta, k_meta, &H, &Hkv, &dev));
  const int64_t To = out_tokens(q_meta, k_meta, opt.broadcast_q);
  MXFLASH_RETURN_IF_ERROR(check_forward_outputs(out, lse, To, H));
  MXFLASH_RETURN_IF_ERROR(check_same_device({{&ops.q, "ops.q"}, {&out, "out"}, {&lse, "lse"}}, &dev));
  if (To == 0) return Status::Ok();
  if (dev == Device::kCPU) {
    std::vector<float> qf, kf, vf;
    dequantized_operands(ops, q_meta, k_meta, H, Hkv, &qf, &kf, &vf);
    return forward_cpu_values(qf, kf, vf, q_meta, k_meta, H, scale, opt.broadcast_q, opt.causal, out, lse);
  }
  MXFLASH_RETURN_IF_ERROR(check_cuda_call(ops.q.device_id, "ops.q", q_meta, k_meta));
  MXFLASH_RETURN_IF_ERROR(check_tma_coordinates("ops.q", H, q_meta, k_meta));
  if (workspace && workspace_bytes < attention_forward_operands_workspace_size(q_meta, k_meta, H, opt))
    return Status::Invalid("workspace: smaller than attention_forward_operands_workspace_size()");
  cuda::AttentionFwdProblem p;
  fill_problem(q_meta, k_meta, H, To, opt.broadcast_q, scale, opt.causal, &p);
  p.kv_heads = int(Hkv);
  p.out = out.data;
  p.lse = lse.ptr<float>();
  return cuda::attention_forward_exec(p, exec_operands(ops), workspace, workspace_bytes, stream);
}

// ------------------------------------------------------------------------------- backward
namespace {

Status check_backward_options(const AttentionBackwardOptions& opt) {
  MXFLASH_RETURN_IF_ERROR(ref::check_causal(opt.causal));
  if (opt.dq_accum != DqAccum::kFp32 && opt.dq_accum != DqAccum::kFp16)
    return Status::Invalid("dq_accum: must be fp32 or fp16, got an unknown value " + std::to_string(int(opt.dq_accum)));
  if (opt.dq_fp16_scale_log2 < 0 || opt.dq_fp16_scale_log2 > 15)
    return Status::Invalid("dq_fp16_scale_log2: must be in 0..15, got " + std::to_string(opt.dq_fp16_scale_log2));
  if (opt.p_scale != PScaleMode::kConstant && opt.p_scale != PScaleMode::kDynamic)
    return Status::Invalid("p_scale: must be constant or dynamic, got an unknown value " + std::to_string(int(opt.p_scale)));
  return Status::Ok();
}

// dK, dV (fp32 values, (Tk, H, 128)) quantized in 32x32 blocks (32 tokens from each K sequence start
// x 32 dims, RCEIL) into `payload`; `scales` (Tk, H, 4) gets each token row's block scale.
Status store_mxfp8(const std::vector<double>& x, const JaggedMeta& km, int64_t H, TensorView payload, TensorView scales) {
  const int64_t T = km.total_tokens();
  std::vector<float> xf(x.begin(), x.end());
  const ScaleShape ss = scale_shape(km, H, Orientation::kSquare32, ScaleLayout::kPlain);  // (P/32, H, 4)
  std::vector<uint8_t> square(size_t(ss.numel()));
  MXFLASH_RETURN_IF_ERROR(quantize(make_view(xf.data(), DType::kFloat32, Device::kCPU, {T, H, kHeadDim}), km,
                                   Orientation::kSquare32, QuantizeOptions{}, payload,
                                   make_view(square.data(), DType::kE8M0, Device::kCPU, ss.ndim, ss.dims)));
  uint8_t* out = scales.ptr<uint8_t>();
  for (int b = 0; b < km.batch(); ++b)
    for (int64_t t = km.cu_seqlens()[b]; t < km.cu_seqlens()[b + 1]; ++t) {
      const int64_t g = (km.cu_seqlens_sf()[b] + t - km.cu_seqlens()[b]) / kBlockSize;
      for (int64_t h = 0; h < H; ++h)
        for (int c = 0; c < kHeadDim / kBlockSize; ++c) out[(t * H + h) * 4 + c] = square[size_t((g * H + h) * 4 + c)];
    }
  return Status::Ok();
}

// CPU: the exact-MX reference on operand values (each operand in its own orientation), out / lse as
// the forward delivered them, dout rounded from bf16.
// Hkv < H (grouped-query attention): ops' K-side values come repeated to H heads, and dk, dv
// (Tk, Hkv, 128) receive each group's sum of the per-head gradients (bf16 outputs only).
Status backward_cpu_values(const ref::AttnOperands& ops, TensorView out, TensorView dout, TensorView lse,
                           const JaggedMeta& qm, const JaggedMeta& km, int64_t H, float scale,
                           const AttentionBackwardOptions& opt, TensorView dq, TensorView dk, TensorView dv,
                           TensorView dk_scales, TensorView dv_scales, int64_t Hkv = 0) {
  Hkv = kv_or(H, Hkv);
  const int64_t no = out.shape[0] * H * kHeadDim;
  ref::AttnForwardResult fwd;
  fwd.out.resize(size_t(no));
  std::vector<float> dout_f(static_cast<size_t>(no));
  const uint16_t* o = out.ptr<const uint16_t>();
  const uint16_t* g = dout.ptr<const uint16_t>();
  for (int64_t i = 0; i < no; ++i) {
    fwd.out[size_t(i)] = bf16_to_float(o[i]);
    dout_f[size_t(i)] = bf16_to_float(g[i]);
  }
  const float* l = lse.ptr<const float>();
  fwd.lse.assign(l, l + lse.shape[0] * lse.shape[1]);
  ref::AttnProblem p;
  p.q_meta = &qm;
  p.k_meta = &km;
  p.heads = H;
  p.softmax_scale = scale;
  p.broadcast_q = opt.broadcast_q;
  p.causal = opt.causal;
  ref::AttnOptions ro;
  ro.dq_fp16_scale_log2 = opt.dq_accum == DqAccum::kFp16 ? opt.dq_fp16_scale_log2 : -1;
  ro.dynamic_p = opt.p_scale == PScaleMode::kDynamic;
  ro.round_outputs = !opt.output_mxfp8_dkv;  // fp32 dK, dV for the MXFP8 outputs (dQ: bf16 below)
  ref::AttnBackwardResult r;
  MXFLASH_RETURN_IF_ERROR(ref::attention_backward_mx_operands(p, ops, fwd, dout_f.data(), &r, ro));
  auto store = [](const std::vector<double>& x, TensorView t) {
    uint16_t* d = t.ptr<uint16_t>();
    for (size_t i = 0; i < x.size(); ++i) d[i] = float_to_bf16(float(x[i]));
  };
  store(r.dq, dq);
  if (Hkv != H) {  // each group's sum, in head order (the CUDA path's order), of the rounded per-head values
    const int64_t g = H / Hkv;
    for (std::vector<double>* x : {&r.dk, &r.dv}) {
      std::vector<double> sum(x->size() / size_t(g), 0.0);
      for (size_t i = 0; i < sum.size(); ++i) {
        const size_t row = i / kHeadDim, d = i % kHeadDim;  // row = t x Hkv + kv head
        for (int64_t j = 0; j < g; ++j) sum[i] += (*x)[(row * size_t(g) + size_t(j)) * kHeadDim + d];
      }
      *x = std::move(sum);
    }
  }
  if (opt.output_mxfp8_dkv) {
    MXFLASH_RETURN_IF_ERROR(store_mxfp8(r.dk, km, H, dk, dk_scales));
    return store_mxfp8(r.dv, km, H, dv, dv_scales);
  }
  store(r.dk, dk);
  store(r.dv, dv);
  return Status::Ok();
}

// CPU: the reference on the dequantized MX operands.
Status backward_cpu(const MxTensor& q, const MxTensor& q_seq, const MxTensor& k, const MxTensor& k_seq, const MxTensor& v,
                    TensorView out, TensorView dout, TensorView lse, const JaggedMeta& qm, const JaggedMeta& km, int64_t H,
                    float scale, const AttentionBackwardOptions& opt, TensorView dq, TensorView dk, TensorView dv,
                    TensorView dk_scales, TensorView dv_scales) {
  ref::AttnOperands ops;
  auto take = [&](const MxTensor& t, const JaggedMeta& m, std::vector<double>* dst) {
    std::vector<float> x;
    MXFLASH_RETURN_IF_ERROR(dequantized(t, m, H, &x));
    dst->assign(x.begin(), x.end());
    return Status::Ok();
  };
  MXFLASH_RETURN_IF_ERROR(take(q, qm, &ops.q_s));
  MXFLASH_RETURN_IF_ERROR(take(q_seq, qm, &ops.q_dk));
  MXFLASH_RETURN_IF_ERROR(take(k, km, &ops.k_s));
  MXFLASH_RETURN_IF_ERROR(take(k_seq, km, &ops.k_dq));
  MXFLASH_RETURN_IF_ERROR(take(v, km, &ops.v_dp));
  return backward_cpu_values(ops, out, dout, lse, qm, km, H, scale, opt, dq, dk, dv, dk_scales, dv_scales);
}

// The backward's tensors other than its operands: out, dout, lse, dq, dk, dv (and MXFP8 dK, dV
// scales) for the metadata and head count.
Status check_backward_io(const TensorView& out, const TensorView& dout, const TensorView& lse, const TensorView& dq,
                         const TensorView& dk, const TensorView& dv, const TensorView& dk_scales,
                         const TensorView& dv_scales, const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t H,
                         const AttentionBackwardOptions& opt, int64_t Hkv = 0) {
  Hkv = kv_or(H, Hkv);
  if (Hkv != H && opt.output_mxfp8_dkv)
    return Status::Unsupported("output_mxfp8_dkv: not with grouped-query attention (K and V with " +
                               std::to_string(Hkv) + " heads, Q with " + std::to_string(H) +
                               "): dK and dV come back bf16 there");
  const int64_t To = out_tokens(q_meta, k_meta, opt.broadcast_q);
  const int64_t o_shape[3] = {To, H, kHeadDim}, lse_shape[2] = {H, To};
  const int64_t q_shape[3] = {q_meta.total_tokens(), H, kHeadDim}, k_shape[3] = {k_meta.total_tokens(), Hkv, kHeadDim};
  MXFLASH_RETURN_IF_ERROR(check_dense(out, "out", {DType::kBFloat16}, 3, o_shape));
  MXFLASH_RETURN_IF_ERROR(check_dense(dout, "dout", {DType::kBFloat16}, 3, o_shape));
  MXFLASH_RETURN_IF_ERROR(check_dense(lse, "lse", {DType::kFloat32}, 2, lse_shape));
  MXFLASH_RETURN_IF_ERROR(check_dense(dq, "dq", {DType::kBFloat16}, 3, q_shape));
  if (opt.output_mxfp8_dkv) {
    const int64_t s_shape[3] = {k_meta.total_tokens(), Hkv, kHeadDim / kBlockSize};
    MXFLASH_RETURN_IF_ERROR(check_dense(dk, "dk", {DType::kE4M3, DType::kUInt8}, 3, k_shape));
    MXFLASH_RETURN_IF_ERROR(check_dense(dv, "dv", {DType::kE4M3, DType::kUInt8}, 3, k_shape));
    MXFLASH_RETURN_IF_ERROR(check_dense(dk_scales, "dk_scales", {DType::kE8M0, DType::kUInt8}, 3, s_shape));
    MXFLASH_RETURN_IF_ERROR(check_dense(dv_scales, "dv_scales", {DType::kE8M0, DType::kUInt8}, 3, s_shape));
  } else {
    MXFLASH_RETURN_IF_ERROR(check_dense(dk, "dk", {DType::kBFloat16}, 3, k_shape));
    MXFLASH_RETURN_IF_ERROR(check_dense(dv, "dv", {DType::kBFloat16}, 3, k_shape));
    for (const auto& [t, n] : {std::pair{&dk_scales, "dk_scales"}, std::pair{&dv_scales, "dv_scales"}})
      if (t->data != nullptr || t->ndim != 0)
        return Status::Invalid(std::string(n) + ": only with output_mxfp8_dkv (leave it empty for bf16 dK, dV)");
  }
  return Status::Ok();
}

// Options outside the CUDA paths' model are refused, never ignored.
Status check_cuda_backward_options(const AttentionBackwardOptions& opt) {
  const std::string path = opt.exact_mx ? "the exact GPU path" : "the fast CUDA kernel";
  if (opt.dq_accum != DqAccum::kFp32)
    return Status::Unsupported("dq_accum: fp16 accumulation is modelled by the CPU reference only; " + path +
                               " accumulates dQ in fp32" + (opt.exact_mx ? "" : " registers (no atomics)"));
  if (opt.p_scale != PScaleMode::kConstant)
    return Status::Unsupported("p_scale: dynamic P scales are modelled by the CPU reference only, not by " + path);
  if (opt.output_mxfp8_dkv && opt.exact_mx)
    return Status::Unsupported("output_mxfp8_dkv: MXFP8 dK, dV come from the CPU reference and the fast CUDA kernel, "
                               "not from the exact GPU path");
  return Status::Ok();
}

// The problem's outputs and forward tensors (device pointers).
void set_backward_io(cuda::AttentionBwdProblem* p, const TensorView& out, const TensorView& dout, const TensorView& lse,
                     const TensorView& dq, const TensorView& dk, const TensorView& dv, const TensorView& dk_scales,
                     const TensorView& dv_scales, const AttentionBackwardOptions& opt) {
  p->out = out.data;
  p->dout = dout.data;
  p->lse = lse.ptr<const float>();
  p->dq = dq.data;
  p->dk = dk.data;
  p->dv = dv.data;
  if (opt.output_mxfp8_dkv) {
    p->mxfp8_dkv = true;
    p->dk_scales = dk_scales.ptr<uint8_t>();
    p->dv_scales = dv_scales.ptr<uint8_t>();
  }
}

}  // namespace

size_t attention_backward_workspace_size(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                         const AttentionBackwardOptions& opt) {
  if (!sizable(q_meta, k_meta, heads, opt.broadcast_q, opt.causal)) return 0;
  cuda::AttentionBwdProblem p;
  fill_problem(q_meta, k_meta, heads, out_tokens(q_meta, k_meta, opt.broadcast_q), opt.broadcast_q, 1.f, opt.causal,
               &p);
  p.Tq = q_meta.total_tokens();
  p.Tk = k_meta.total_tokens();
  p.mxfp8_dkv = opt.output_mxfp8_dkv;
  return cuda::attention_bwd_workspace_bytes(p);
}

Status attention_backward(const MxTensor& q, const MxTensor& q_seq, const MxTensor& k, const MxTensor& k_seq,
                          const MxTensor& v, TensorView out, TensorView dout, TensorView lse, const JaggedMeta& q_meta,
                          const JaggedMeta& k_meta, const AttentionBackwardOptions& opt, TensorView dq, TensorView dk,
                          TensorView dv, TensorView dk_scales, TensorView dv_scales, void* workspace,
                          size_t workspace_bytes, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_metas(q_meta, k_meta, opt.broadcast_q));
  const float scale = resolved_scale(opt.softmax_scale);
  MXFLASH_RETURN_IF_ERROR(check_scale(scale));
  MXFLASH_RETURN_IF_ERROR(check_backward_options(opt));
  int64_t H = 0;
  MXFLASH_RETURN_IF_ERROR(check_operand(q, "q", Orientation::kHdim, q_meta, &H));
  MXFLASH_RETURN_IF_ERROR(check_operand(q_seq, "q_seq", Orientation::kSeq, q_meta, &H));
  MXFLASH_RETURN_IF_ERROR(check_operand(k, "k", Orientation::kHdim, k_meta, &H));
  MXFLASH_RETURN_IF_ERROR(check_operand(k_seq, "k_seq", Orientation::kSeq, k_meta, &H));
  MXFLASH_RETURN_IF_ERROR(check_operand(v, "v", Orientation::kHdim, k_meta, &H));
  const int64_t To = out_tokens(q_meta, k_meta, opt.broadcast_q);
  MXFLASH_RETURN_IF_ERROR(check_backward_io(out, dout, lse, dq, dk, dv, dk_scales, dv_scales, q_meta, k_meta, H, opt));
  Device dev = Device::kCPU;
  MXFLASH_RETURN_IF_ERROR(check_same_device({{&q.payload, "q.payload"},
                                             {&q.scales, "q.scales"},
                                             {&q_seq.payload, "q_seq.payload"},
                                             {&q_seq.scales, "q_seq.scales"},
                                             {&k.payload, "k.payload"},
                                             {&k.scales, "k.scales"},
                                             {&k_seq.payload, "k_seq.payload"},
                                             {&k_seq.scales, "k_seq.scales"},
                                             {&v.payload, "v.payload"},
                                             {&v.scales, "v.scales"},
                                             {&out, "out"},
                                             {&dout, "dout"},
                                             {&lse, "lse"},
                                             {&dq, "dq"},
                                             {&dk, "dk"},
                                             {&dv, "dv"}},
                                            &dev));
  if (opt.output_mxfp8_dkv) {
    Device scales_dev = dev;
    MXFLASH_RETURN_IF_ERROR(
        check_same_device({{&dk, "dk"}, {&dk_scales, "dk_scales"}, {&dv_scales, "dv_scales"}}, &scales_dev));
  }
  if (dev == Device::kCPU)
    return backward_cpu(q, q_seq, k, k_seq, v, out, dout, lse, q_meta, k_meta, H, scale, opt, dq, dk, dv, dk_scales,
                        dv_scales);
  MXFLASH_RETURN_IF_ERROR(check_cuda_backward_options(opt));
  MXFLASH_RETURN_IF_ERROR(check_cuda_call(q.payload.device_id, "q.payload", q_meta, k_meta));
  cuda::AttentionBwdProblem p;
  fill_problem(q_meta, k_meta, H, To, opt.broadcast_q, scale, opt.causal, &p);
  p.Tq = q_meta.total_tokens();
  p.Tk = k_meta.total_tokens();
  p.q = device_operand(q);
  p.q_seq = device_operand(q_seq);
  p.k = device_operand(k);
  p.k_seq = device_operand(k_seq);
  p.v = device_operand(v);
  set_backward_io(&p, out, dout, lse, dq, dk, dv, dk_scales, dv_scales, opt);
  if (opt.exact_mx) return cuda::attention_backward_exact(p, stream);
  return cuda::attention_backward(p, workspace, workspace_bytes, stream);  // checks the workspace size first
}

// -------------------------------------------------------------------- backward operands
namespace {

// The backward operands' checks (check_operand_parts), named `set`.name in messages. Heads from q,
// K and V's from k.
Status check_bwd_operands(const AttentionBwdOperands& ops, const JaggedMeta& q_meta, const JaggedMeta& k_meta,
                          int64_t* heads, int64_t* kv_heads, Device* dev, const std::string& set = "ops") {
  MXFLASH_RETURN_IF_ERROR(operand_heads(ops.q, ops.k, set, heads, kv_heads));
  const AttentionBwdOperandShapes sh = attention_bwd_operand_shapes(q_meta, k_meta, *heads, *kv_heads);
  return check_operand_parts(operand_table(ops, sh), set, dev);
}

cuda::BwdExecOperands bwd_exec_operands(const AttentionBwdOperands& ops) {
  cuda::BwdExecOperands e;
  e.q = static_cast<uint8_t*>(ops.q.data);
  e.k = static_cast<uint8_t*>(ops.k.data);
  e.v = static_cast<uint8_t*>(ops.v.data);
  e.qt = static_cast<uint8_t*>(ops.qt.data);
  e.kt = static_cast<uint8_t*>(ops.kt.data);
  e.q_scale = static_cast<float*>(ops.q_scale.data);
  e.k_scale = static_cast<float*>(ops.k_scale.data);
  e.v_scale = static_cast<float*>(ops.v_scale.data);
  e.qt_scale = static_cast<float*>(ops.qt_scale.data);
  e.kt_scale = static_cast<float*>(ops.kt_scale.data);
  return e;
}

}  // namespace

AttentionBwdOperandShapes attention_bwd_operand_shapes(const JaggedMeta& q_meta, const JaggedMeta& k_meta,
                                                       int64_t heads, int64_t kv_heads) {
  const int64_t Pq = q_meta.padded_tokens(), Pk = k_meta.padded_tokens(), kvh = kv_or(heads, kv_heads);
  return {{heads, Pq, kHeadDim}, {heads, Pq},           {kvh, Pk, kHeadDim}, {kvh, Pk / kTileTokens},
          {kvh, Pk, kHeadDim},   {kvh, Pk / kTileTokens}, {heads, kHeadDim, Pq}, {heads, Pq / kTileTokens},
          {kvh, kHeadDim, Pk},   {kvh, Pk / kTileTokens}};
}

void attention_bwd_operand_bytes(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                 size_t bytes[kAttentionBwdOperandCount], int64_t kv_heads) {
  operand_bytes<AttentionBwdOperands>(attention_bwd_operand_shapes(q_meta, k_meta, heads, kv_heads), bytes);
}

AttentionBwdOperands attention_bwd_operand_views(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                                 void* const data[kAttentionBwdOperandCount], Device device,
                                                 int device_id, int64_t kv_heads) {
  return operand_views<AttentionBwdOperands>(attention_bwd_operand_shapes(q_meta, k_meta, heads, kv_heads), data,
                                             device, device_id);
}

Status quantize_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                   const JaggedMeta& q_meta, const JaggedMeta& k_meta, const AttentionBwdOperands& ops,
                                   void* stream, bool write_qk) {
  int64_t H = 0, Hkv = 0;
  MXFLASH_RETURN_IF_ERROR(check_quantize_inputs(q, k, v, q_meta, k_meta, &H, &Hkv));
  int64_t oh = 0, okv = 0;
  Device od = Device::kCPU, xd = Device::kCPU;
  MXFLASH_RETURN_IF_ERROR(check_bwd_operands(ops, q_meta, k_meta, &oh, &okv, &od));
  MXFLASH_RETURN_IF_ERROR(check_operand_heads(oh, okv, H, Hkv, "ops"));
  MXFLASH_RETURN_IF_ERROR(check_same_device({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&ops.q, "ops.q"}}, &xd));
  if (xd == Device::kCPU) {
    const std::vector<float> qf = as_f32(q), kf = as_f32(k), vf = as_f32(v);
    // The forward's rules per output: Q', K' as the forward's q, k; V rows as its k (per tile); Qᵀ',
    // Kᵀ' as its v (token-contiguous per tile), each on its own sequences.
    ref::AttnFwdOperands fwd, kv, qq;
    if (write_qk) MXFLASH_RETURN_IF_ERROR(fwd_operands_cpu(q_meta, k_meta, H, Hkv, qf, kf, vf, &fwd));
    MXFLASH_RETURN_IF_ERROR(ref::attention_fwd_operands(k_meta, k_meta, Hkv, kf.data(), vf.data(), kf.data(), &kv));
    MXFLASH_RETURN_IF_ERROR(ref::attention_fwd_operands(q_meta, q_meta, H, qf.data(), qf.data(), qf.data(), &qq));
    if (write_qk) {
      copy_into(fwd.q, ops.q);
      copy_into(fwd.q_scale, ops.q_scale);
      copy_into(fwd.k, ops.k);
      copy_into(fwd.k_scale, ops.k_scale);
    }
    copy_into(kv.k, ops.v);
    copy_into(kv.k_scale, ops.v_scale);
    copy_into(kv.v, ops.kt);
    copy_into(kv.v_scale, ops.kt_scale);
    copy_into(qq.v, ops.qt);
    copy_into(qq.v_scale, ops.qt_scale);
    return Status::Ok();
  }
  MXFLASH_RETURN_IF_ERROR(check_cuda_call(q.device_id, "q", q_meta, k_meta));
  cuda::AttentionBwdProblem p;
  fill_problem(q_meta, k_meta, H, q_meta.total_tokens(), false, 1.f, CausalMask::kNone, &p);
  p.kv_heads = int(Hkv);
  p.broadcast_q = q_meta.batch() != k_meta.batch();  // the kernels take Q's sequence count from it
  return cuda::quantize_attention_bwd_operands(p, q.data, k.data, v.data, q.dtype == DType::kFloat32,
                                               bwd_exec_operands(ops), write_qk, stream);
}

namespace {

// quantize_attention_training's operand sets: fwd and bwd for the metadata, H Q heads and Hkv K/V
// heads, bwd's Q' and K' viewing fwd's.
Status check_training_sets(const AttentionFwdOperands& fwd, const AttentionBwdOperands& bwd, const JaggedMeta& q_meta,
                           const JaggedMeta& k_meta, int64_t H, int64_t Hkv) {
  int64_t fh = 0, bh = 0, fkv = 0, bkv = 0;
  Device fd = Device::kCPU, bd = Device::kCPU;
  MXFLASH_RETURN_IF_ERROR(check_operands(fwd, q_meta, k_meta, &fh, &fkv, &fd, "fwd"));
  MXFLASH_RETURN_IF_ERROR(check_bwd_operands(bwd, q_meta, k_meta, &bh, &bkv, &bd, "bwd"));
  MXFLASH_RETURN_IF_ERROR(check_operand_heads(fh, fkv, H, Hkv, "fwd"));
  MXFLASH_RETURN_IF_ERROR(check_operand_heads(bh, bkv, H, Hkv, "bwd"));
  for (const auto& [b, f, n] : {std::tuple{&bwd.q, &fwd.q, "q"}, std::tuple{&bwd.q_scale, &fwd.q_scale, "q_scale"},
                                std::tuple{&bwd.k, &fwd.k, "k"}, std::tuple{&bwd.k_scale, &fwd.k_scale, "k_scale"}})
    if (b->data != f->data)
      return Status::Invalid(std::string("bwd.") + n + ": must view fwd." + n +
                             "'s memory (the backward's Q' and K' are the forward's bytes, written once through fwd)");
  return Status::Ok();
}

}  // namespace

Status quantize_attention_training(const TensorView& q, const TensorView& k, const TensorView& v,
                                   const JaggedMeta& q_meta, const JaggedMeta& k_meta, const AttentionFwdOperands& fwd,
                                   const AttentionBwdOperands& bwd, void* stream) {
  int64_t H = 0, Hkv = 0;
  MXFLASH_RETURN_IF_ERROR(check_quantize_inputs(q, k, v, q_meta, k_meta, &H, &Hkv));
  Device xd = Device::kCPU;
  MXFLASH_RETURN_IF_ERROR(check_training_sets(fwd, bwd, q_meta, k_meta, H, Hkv));
  MXFLASH_RETURN_IF_ERROR(
      check_same_device({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&fwd.q, "fwd.q"}, {&bwd.v, "bwd.v"}}, &xd));
  if (xd == Device::kCPU) {  // the two quantizers (their checks pass: they are the ones above)
    MXFLASH_RETURN_IF_ERROR(quantize_attention_forward(q, k, v, q_meta, k_meta, fwd, stream));
    return quantize_attention_backward(q, k, v, q_meta, k_meta, bwd, stream, /*write_qk=*/false);
  }
  MXFLASH_RETURN_IF_ERROR(check_cuda_call(q.device_id, "q", q_meta, k_meta));
  cuda::AttentionFwdProblem p;
  fill_problem(q_meta, k_meta, H, q_meta.total_tokens(), false, 1.f, CausalMask::kNone, &p);
  p.kv_heads = int(Hkv);
  p.broadcast_q = q_meta.batch() != k_meta.batch();  // the kernels take Q's sequence count from it
  return cuda::quantize_attention_training_operands(p, q.data, k.data, v.data, q.dtype == DType::kFloat32,
                                                    exec_operands(fwd), bwd_exec_operands(bwd), stream);
}

Status quantize_attention_training(const TensorView& q, const MxTensor& k, const MxTensor& v,
                                   const JaggedMeta& q_meta, const JaggedMeta& k_meta, const AttentionFwdOperands& fwd,
                                   const AttentionBwdOperands& bwd, void* stream) {
  int64_t H = 0;
  MXFLASH_RETURN_IF_ERROR(check_quantize_q(q, q_meta, k_meta, &H));
  MXFLASH_RETURN_IF_ERROR(check_operand(k, "k", Orientation::kHdim, k_meta, &H));
  MXFLASH_RETURN_IF_ERROR(check_operand(v, "v", Orientation::kHdim, k_meta, &H));
  for (const auto& [t, n] : {std::pair{&k, "k.scale_layout"}, std::pair{&v, "v.scale_layout"}})
    if (t->scale_layout != ScaleLayout::kPlain) return Status::Invalid(std::string(n) + ": must be plain");
  Device dev = Device::kCPU;
  MXFLASH_RETURN_IF_ERROR(check_same_device(
      {{&q, "q"}, {&k.payload, "k.payload"}, {&k.scales, "k.scales"}, {&v.payload, "v.payload"},
       {&v.scales, "v.scales"}},
      &dev));
  if (dev == Device::kCPU) {
    // The definition: K and V as bf16 values (widened to fp32 beside an fp32 q: exact), then the
    // quantizer of unquantized inputs, whose checks cover the operand sets.
    const int64_t shape[3] = {k_meta.total_tokens(), H, kHeadDim};
    const size_t n = size_t(shape[0] * H * kHeadDim);
    std::vector<uint16_t> kb(n), vb(n);
    MXFLASH_RETURN_IF_ERROR(dequantize(k.payload, k.scales, k_meta, Orientation::kHdim, ScaleLayout::kPlain,
                                       PayloadLayout::kTokenMajor,
                                       make_view(kb.data(), DType::kBFloat16, Device::kCPU, 3, shape)));
    MXFLASH_RETURN_IF_ERROR(dequantize(v.payload, v.scales, k_meta, Orientation::kHdim, ScaleLayout::kPlain,
                                       PayloadLayout::kTokenMajor,
                                       make_view(vb.data(), DType::kBFloat16, Device::kCPU, 3, shape)));
    if (q.dtype == DType::kBFloat16)
      return quantize_attention_training(q, make_view(kb.data(), DType::kBFloat16, Device::kCPU, 3, shape),
                                         make_view(vb.data(), DType::kBFloat16, Device::kCPU, 3, shape), q_meta,
                                         k_meta, fwd, bwd, stream);
    std::vector<float> kf(n), vf(n);
    for (size_t i = 0; i < n; ++i) kf[i] = bf16_to_float(kb[i]), vf[i] = bf16_to_float(vb[i]);
    return quantize_attention_training(q, make_view(kf.data(), DType::kFloat32, Device::kCPU, 3, shape),
                                       make_view(vf.data(), DType::kFloat32, Device::kCPU, 3, shape), q_meta, k_meta,
                                       fwd, bwd, stream);
  }
  MXFLASH_RETURN_IF_ERROR(check_training_sets(fwd, bwd, q_meta, k_meta, H, H));
  MXFLASH_RETURN_IF_ERROR(check_same_device({{&q, "q"}, {&fwd.q, "fwd.q"}, {&bwd.v, "bwd.v"}}, &dev));
  MXFLASH_RETURN_IF_ERROR(check_cuda_call(q.device_id, "q", q_meta, k_meta));
  cuda::AttentionFwdProblem p;
  fill_problem(q_meta, k_meta, H, q_meta.total_tokens(), false, 1.f, CausalMask::kNone, &p);
  p.broadcast_q = q_meta.batch() != k_meta.batch();  // the kernels take Q's sequence count from it
  cuda::MxKvSource src;
  src.k = k.payload.ptr<uint8_t>();
  src.k_scales = k.scales.ptr<uint8_t>();
  src.v = v.payload.ptr<uint8_t>();
  src.v_scales = v.scales.ptr<uint8_t>();
  return cuda::quantize_attention_training_operands_mx_kv(p, q.data, q.dtype == DType::kFloat32, src,
                                                          exec_operands(fwd), bwd_exec_operands(bwd), stream);
}

size_t attention_backward_operands_workspace_size(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                                  const AttentionBackwardOptions& opt, int64_t kv_heads) {
  if (!sizable(q_meta, k_meta, heads, opt.broadcast_q, opt.causal)) return 0;
  const int64_t kvh = kv_or(heads, kv_heads);
  if (heads % kvh != 0 || (kvh != heads && opt.output_mxfp8_dkv)) return 0;  // (the call rejects them)
  cuda::AttentionBwdProblem p;
  fill_problem(q_meta, k_meta, heads, out_tokens(q_meta, k_meta, opt.broadcast_q), opt.broadcast_q, 1.f, opt.causal,
               &p);
  p.kv_heads = int(kvh);
  p.Tq = q_meta.total_tokens();
  p.Tk = k_meta.total_tokens();
  p.mxfp8_dkv = opt.output_mxfp8_dkv;
  const cuda::BwdExecOperands none;
  p.exec = &none;  // (sizes only)
  return cuda::attention_bwd_workspace_bytes(p);
}

Status attention_backward(const AttentionBwdOperands& ops, TensorView out, TensorView dout, TensorView lse,
                          const JaggedMeta& q_meta, const JaggedMeta& k_meta, const AttentionBackwardOptions& opt,
                          TensorView dq, TensorView dk, TensorView dv, TensorView dk_scales, TensorView dv_scales,
                          void* workspace, size_t workspace_bytes, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_metas(q_meta, k_meta, opt.broadcast_q));
  const float scale = resolved_scale(opt.softmax_scale);
  MXFLASH_RETURN_IF_ERROR(check_scale(scale));
  MXFLASH_RETURN_IF_ERROR(check_backward_options(opt));
  if (opt.exact_mx)
    return Status::Unsupported("opt.exact_mx: the exact-MX path takes MX tensors, not execution-layout operands");
  int64_t H = 0, Hkv = 0;
  Device dev = Device::kCPU;
  MXFLASH_RETURN_IF_ERROR(check_bwd_operands(ops, q_meta, k_meta, &H, &Hkv, &dev));
  MXFLASH_RETURN_IF_ERROR(
      check_backward_io(out, dout, lse, dq, dk, dv, dk_scales, dv_scales, q_meta, k_meta, H, opt, Hkv));
  MXFLASH_RETURN_IF_ERROR(check_same_device(
      {{&ops.q, "ops.q"}, {&out, "out"}, {&dout, "dout"}, {&lse, "lse"}, {&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}}, &dev));
  if (opt.output_mxfp8_dkv) {
    Device scales_dev = dev;
    MXFLASH_RETURN_IF_ERROR(
        check_same_device({{&dk, "dk"}, {&dk_scales, "dk_scales"}, {&dv_scales, "dv_scales"}}, &scales_dev));
  }
  if (dev == Device::kCPU) {
    ref::AttnOperands r;
    std::vector<float> x;
    auto keep = [&](std::vector<double>* dst) { dst->assign(x.begin(), x.end()); };
    rows_values(ops.q, ops.q_scale, q_meta, H, true, &x);
    keep(&r.q_s);
    tokens_values(ops.qt, ops.qt_scale, q_meta, H, &x);
    keep(&r.q_dk);
    auto keep_kv = [&](std::vector<double>* dst) {  // K and V repeated to H heads (grouped-query attention)
      x = repeat_heads(x, Hkv, H / Hkv);
      keep(dst);
    };
    rows_values(ops.k, ops.k_scale, k_meta, Hkv, false, &x);
    keep_kv(&r.k_s);
    tokens_values(ops.kt, ops.kt_scale, k_meta, Hkv, &x);
    keep_kv(&r.k_dq);
    rows_values(ops.v, ops.v_scale, k_meta, Hkv, false, &x);
    keep_kv(&r.v_dp);
    return backward_cpu_values(r, out, dout, lse, q_meta, k_meta, H, scale, opt, dq, dk, dv, dk_scales, dv_scales,
                               Hkv);
  }
  MXFLASH_RETURN_IF_ERROR(check_cuda_backward_options(opt));
  MXFLASH_RETURN_IF_ERROR(check_cuda_call(ops.q.device_id, "ops.q", q_meta, k_meta));
  MXFLASH_RETURN_IF_ERROR(check_tma_coordinates("ops.q", H, q_meta, k_meta));
  cuda::AttentionBwdProblem p;
  fill_problem(q_meta, k_meta, H, out_tokens(q_meta, k_meta, opt.broadcast_q), opt.broadcast_q, scale, opt.causal, &p);
  p.kv_heads = int(Hkv);
  p.Tq = q_meta.total_tokens();
  p.Tk = k_meta.total_tokens();
  const cuda::BwdExecOperands exec = bwd_exec_operands(ops);
  p.exec = &exec;
  set_backward_io(&p, out, dout, lse, dq, dk, dv, dk_scales, dv_scales, opt);
  return cuda::attention_backward(p, workspace, workspace_bytes, stream);  // checks the workspace size first
}

}  // namespace mxflash
