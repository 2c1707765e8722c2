"""mxflash.attention_forward: the exact-MX CPU path against an FP64 numpy attention on the
unquantized inputs (written here), broadcast_q against per-sequence calls, softmax_scale, bad
arguments (ValueError with the C++ message, outputs untouched), and the CUDA kernel against the CPU
path on the same MX inputs. CUDA tests skip, saying why, without torch, a CUDA device, a CUDA build
or an sm_90 device (MXFLASH_REQUIRE_CUDA=1 turns those skips into failures)."""
import importlib.util
import math
import re

import ml_dtypes
import numpy as np
import pytest

import mxflash
from mxflash import _mxflash

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
H = 2
Q_LENGTHS = [40, 0, 70]
K_LENGTHS = [33, 5, 0]  # sequence 2 has queries but no keys; sequence 1 keys but no queries
DEFAULT_SCALE = 1.0 / math.sqrt(128)


# ---------------------------------------------------------------------------- helpers
def cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def attention_fp64(q, k, v, q_lengths, k_lengths, scale=DEFAULT_SCALE, broadcast_q=False):
    """Exact attention in float64 on packed (T, H, 128) arrays: (out (To, H, 128), lse (H, To))."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    qc, kc = cu(q_lengths), cu(k_lengths)
    B = len(k_lengths)
    lq = q_lengths[0]
    To = B * lq if broadcast_q else int(qc[-1])
    out = np.zeros((To, q.shape[1], 128))
    lse = np.full((q.shape[1], To), -np.inf)
    for b in range(B):
        qs = q if broadcast_q else q[qc[b]:qc[b + 1]]
        o0 = b * lq if broadcast_q else int(qc[b])
        ks, vs = k[kc[b]:kc[b + 1]], v[kc[b]:kc[b + 1]]
        if len(qs) == 0 or len(ks) == 0:
            continue
        s = np.einsum("ihd,jhd->hij", qs, ks) * scale
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        l = p.sum(-1)
        out[o0:o0 + len(qs)] = np.einsum("hij,jhd->ihd", p, vs) / l.T[:, :, None]
        lse[:, o0:o0 + len(qs)] = m[..., 0] + np.log(l)
    return out, lse


def sqnr_db(ref, x):
    ref, x = np.asarray(ref, np.float64), np.asarray(x, np.float64)
    return 10 * np.log10(np.sum(ref ** 2) / np.sum((x - ref) ** 2))


def key_rows(q_lengths, k_lengths):
    """Boolean mask of the output tokens whose sequence has keys (non-broadcast)."""
    return np.repeat([n > 0 for n in k_lengths], q_lengths)


def inputs(q_lengths, k_lengths, heads=H, seed=0):
    rng = np.random.default_rng(seed)
    tq, tk = sum(q_lengths), sum(k_lengths)
    return (rng.standard_normal((tq, heads, 128)).astype(np.float32),
            rng.standard_normal((tk, heads, 128)).astype(np.float32),
            rng.standard_normal((tk, heads, 128)).astype(np.float32))


def mx_operands(x_q, x_k, x_v, q_meta, k_meta, scale_layout="plain", v_payload_layout="token_major"):
    return (mxflash.quantize_mx(x_q, q_meta, "hdim", scale_layout=scale_layout),
            mxflash.quantize_mx(x_k, k_meta, "hdim", scale_layout=scale_layout),
            mxflash.quantize_mx(x_v, k_meta, "seq", scale_layout=scale_layout, payload_layout=v_payload_layout))


def check_lse_exact(lse, ops, q_meta, k_meta, scale, rows, q_lengths=Q_LENGTHS, k_lengths=K_LENGTHS):
    """lse is computed from the unquantized P: on the dequantized MX inputs it is exact to fp32."""
    dq, dk, dv = (t.dequantize(m) for t, m in zip(ops, (q_meta, k_meta, k_meta)))
    _, want = attention_fp64(dq, dk, dv, q_lengths, k_lengths, scale)
    err = np.abs(lse[:, rows] - want[:, rows]) / np.maximum(1.0, np.abs(want[:, rows]))
    assert err.max() < 1e-5, f"lse vs FP64 on the dequantized inputs: relative error {err.max():.1e}"


def raises_exactly(exc, message):
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


def sentinel(shape, dtype):
    """An array of dtype filled with 0xAB bytes."""
    return np.full(tuple(shape) + (np.dtype(dtype).itemsize,), 0xAB, np.uint8).view(dtype).reshape(shape)


def untouched(*arrays):
    return all(bool((np.asarray(a).view(np.uint8) == 0xAB).all()) for a in arrays)


@pytest.fixture(scope="module")
def case():
    qm, km = mxflash.JaggedMeta.from_lengths(Q_LENGTHS), mxflash.JaggedMeta.from_lengths(K_LENGTHS)
    xq, xk, xv = inputs(Q_LENGTHS, K_LENGTHS)
    return qm, km, (xq, xk, xv), mx_operands(xq, xk, xv, qm, km)


# ---------------------------------------------------------------------------- CPU
def test_quantize_mx_records_the_layout(case):
    qm, km, (xq, xk, xv), _ = case
    v = mxflash.quantize_mx(xv, km, "seq", scale_layout="blocked128x4", payload_layout="token_contiguous")
    assert isinstance(v, mxflash.MxTensor)
    assert (v.orientation, v.scale_layout, v.payload_layout) == ("seq", "blocked128x4", "token_contiguous")
    p, s = mxflash.quantize(xv, km, "seq", scale_layout="blocked128x4", payload_layout="token_contiguous")
    assert np.array_equal(v.payload.view(np.uint8), p.view(np.uint8)) and np.array_equal(v.scales, s)
    assert np.array_equal(v.dequantize(km), mxflash.dequantize(p, s, km, "seq", "blocked128x4", "token_contiguous"))


def test_cpu_matches_fp64_attention(case):
    qm, km, (xq, xk, xv), (q, k, v) = case
    out, lse = mxflash.attention_forward(q, k, v, qm, km)
    To = sum(Q_LENGTHS)
    assert out.dtype == BF16 and out.shape == (To, H, 128)
    assert lse.dtype == np.float32 and lse.shape == (H, To)
    ref_out, ref_lse = attention_fp64(xq, xk, xv, Q_LENGTHS, K_LENGTHS)
    rows = key_rows(Q_LENGTHS, K_LENGTHS)
    assert rows.sum() == 40
    db = sqnr_db(ref_out[rows], out[rows].astype(np.float32))
    assert db > 20, f"out SQNR {db:.1f} dB vs FP64 attention"
    assert np.max(np.abs(lse[:, rows] - ref_lse[:, rows])) < 1.5 * DEFAULT_SCALE
    check_lse_exact(lse, (q, k, v), qm, km, DEFAULT_SCALE, rows)
    # rows of a sequence without keys: out 0, lse -inf
    assert np.all(out[~rows].astype(np.float32) == 0)
    assert np.all(np.isneginf(lse[:, ~rows]))


def test_cpu_all_layouts_agree(case):
    # blocked scales and a token-contiguous V describe the same MX values: identical results
    qm, km, (xq, xk, xv), (q, k, v) = case
    want = mxflash.attention_forward(q, k, v, qm, km)
    got = mxflash.attention_forward(*mx_operands(xq, xk, xv, qm, km, "blocked128x4", "token_contiguous"), qm, km)
    assert np.array_equal(want[0].view(np.uint16), got[0].view(np.uint16))
    assert np.array_equal(want[1], got[1])


def test_broadcast_q_equals_per_sequence_calls():
    lq, k_lengths = 37, [33, 5, 0, 50]
    xq, xk, xv = inputs([lq], k_lengths, seed=1)
    qm, km = mxflash.JaggedMeta.from_lengths([lq]), mxflash.JaggedMeta.from_lengths(k_lengths)
    q, k, v = mx_operands(xq, xk, xv, qm, km)
    out, lse = mxflash.attention_forward(q, k, v, qm, km, broadcast_q=True)
    B = len(k_lengths)
    assert out.shape == (B * lq, H, 128) and lse.shape == (H, B * lq)
    kc = cu(k_lengths)
    for b, n in enumerate(k_lengths):
        kmb = mxflash.JaggedMeta.from_lengths([n])
        kb = mxflash.quantize_mx(xk[kc[b]:kc[b + 1]], kmb, "hdim")
        vb = mxflash.quantize_mx(xv[kc[b]:kc[b + 1]], kmb, "seq")
        ob, lb = mxflash.attention_forward(q, kb, vb, qm, kmb)
        assert np.array_equal(out[b * lq:(b + 1) * lq].view(np.uint16), ob.view(np.uint16)), f"sequence {b}"
        assert np.array_equal(lse[:, b * lq:(b + 1) * lq], lb), f"sequence {b}"
    ref_out, _ = attention_fp64(xq, xk, xv, [lq], k_lengths, broadcast_q=True)
    rows = np.repeat([n > 0 for n in k_lengths], lq)
    assert sqnr_db(ref_out[rows], out[rows].astype(np.float32)) > 20
    assert np.all(np.isneginf(lse[:, ~rows])) and np.all(out[~rows].astype(np.float32) == 0)


def test_softmax_scale_honoured(case):
    qm, km, (xq, xk, xv), (q, k, v) = case
    rows = key_rows(Q_LENGTHS, K_LENGTHS)
    default = mxflash.attention_forward(q, k, v, qm, km)
    explicit = mxflash.attention_forward(q, k, v, qm, km, softmax_scale=DEFAULT_SCALE)
    assert np.array_equal(default[0].view(np.uint16), explicit[0].view(np.uint16))
    assert np.array_equal(default[1], explicit[1])
    results = {}
    for scale in (0.03, 0.3):
        out, lse = mxflash.attention_forward(q, k, v, qm, km, softmax_scale=scale)
        ref_out, ref_lse = attention_fp64(xq, xk, xv, Q_LENGTHS, K_LENGTHS, scale)
        assert sqnr_db(ref_out[rows], out[rows].astype(np.float32)) > 20, f"softmax_scale={scale}"
        # the quantization error of S, hence of lse, grows with the scale
        assert np.max(np.abs(lse[:, rows] - ref_lse[:, rows])) < 1.5 * scale, f"softmax_scale={scale}"
        check_lse_exact(lse, (q, k, v), qm, km, scale, rows)
        results[scale] = out[rows].astype(np.float32)
    # the two scales give clearly different attention (sharper softmax at 0.3)
    assert sqnr_db(results[0.3], results[0.03]) < 10


def test_out_argument_is_written_and_returned(case):
    qm, km, _, (q, k, v) = case
    To = sum(Q_LENGTHS)
    o, l = sentinel((To, H, 128), BF16), sentinel((H, To), np.float32)
    ro, rl = mxflash.attention_forward(q, k, v, qm, km, out=(o, l))
    assert ro is o and rl is l
    want = mxflash.attention_forward(q, k, v, qm, km)
    assert np.array_equal(o.view(np.uint16), want[0].view(np.uint16)) and np.array_equal(l, want[1])


def test_torch_cpu_tensors_use_the_reference(case):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import torch
    qm, km, _, (q, k, v) = case
    tq, tk, tv = (mxflash.MxTensor(torch_of(t.payload, torch, "cpu"), torch_of(t.scales, torch, "cpu"), t.orientation)
                  for t in (q, k, v))
    out, lse = mxflash.attention_forward(tq, tk, tv, qm, km)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want = mxflash.attention_forward(q, k, v, qm, km)
    assert np.array_equal(out.view(torch.int16).numpy().view(np.uint16), want[0].view(np.uint16))
    assert np.array_equal(lse.numpy(), want[1])


# ---------------------------------------------------------------------------- bad arguments
def with_orientation(t, o):
    return mxflash.MxTensor(t.payload, t.scales, o, t.scale_layout, t.payload_layout)


def non_contiguous(t):
    p = np.ascontiguousarray(t.payload.transpose(1, 0, 2)).transpose(1, 0, 2)
    return mxflash.MxTensor(p, t.scales, t.orientation, t.scale_layout, t.payload_layout)


def bad_cases(case):
    qm, km, (xq, xk, xv), (q, k, v) = case
    To = sum(Q_LENGTHS)
    k3 = mxflash.quantize_mx(np.concatenate([xk, xk[:, :1]], axis=1), km, "hdim")
    return [
        (dict(q=with_orientation(q, "seq")), "q.orientation: must be hdim, got seq"),
        (dict(k=with_orientation(k, "square32")), "k.orientation: must be hdim, got square32"),
        (dict(v=with_orientation(v, "hdim")), "v.orientation: must be seq, got hdim"),
        (dict(k=k3), "k.payload: has 3 heads, q has 2"),
        (dict(broadcast_q=True), "q_meta: broadcast_q needs exactly one Q sequence, got 3"),
        (dict(q_meta=mxflash.JaggedMeta.from_lengths([40, 70])), "q_meta: has 2 sequences but k_meta has 3 "
                                                                   "(use broadcast_q for one shared Q sequence)"),
        (dict(out=(sentinel((To, H, 128), np.float32), None)), "out: dtype must be bfloat16, got float32"),
        (dict(out=(sentinel((To + 1, H, 128), BF16), None)), f"out: shape must be ({To}, {H}, 128), "
                                                             f"got ({To + 1}, {H}, 128)"),
        (dict(out=(None, sentinel((To, H), np.float32))), f"lse: shape must be ({H}, {To}), got ({To}, {H})"),
        (dict(q=non_contiguous(q)), "q.payload: must be contiguous (row-major, no gaps)"),
        (dict(v=non_contiguous(v)), "v.payload: must be contiguous (row-major, no gaps)"),
        (dict(q=mxflash.MxTensor(q.payload, q.scales, "hdim", "blocked")),
         "q.scale_layout: must be plain or blocked128x4"),
        (dict(softmax_scale=-1.0), "softmax_scale: must be a finite positive number"),
        (dict(softmax_scale=float("inf")), "softmax_scale: must be a finite positive number"),
    ]


def test_bad_arguments_raise_the_library_message_and_write_nothing(case):
    qm, km, _, (q, k, v) = case
    To = sum(Q_LENGTHS)
    for change, message in bad_cases(case):
        args = dict(q=q, k=k, v=v, q_meta=qm, k_meta=km)
        args.update(change)
        o, l = args.pop("out", (None, None))
        o = sentinel((To, H, 128), BF16) if o is None else o
        l = sentinel((H, To), np.float32) if l is None else l
        with raises_exactly(ValueError, message):
            mxflash.attention_forward(**args, out=(o, l))
        assert untouched(o, l), f"outputs written although the call failed with {message!r}"


def test_python_level_type_errors(case):
    qm, km, _, (q, k, v) = case
    with pytest.raises(TypeError, match="^q: expected mxflash.MxTensor"):
        mxflash.attention_forward((q.payload, q.scales), k, v, qm, km)
    with pytest.raises(TypeError, match="^k_meta: expected mxflash.JaggedMeta"):
        mxflash.attention_forward(q, k, v, qm, [33, 5, 0])
    with raises_exactly(ValueError, "out: must be a tuple (out, lse)"):
        mxflash.attention_forward(q, k, v, qm, km, out=np.zeros(3))


def test_non_invalid_status_is_runtime_error(case):
    # In a CPU-only build CUDA views pass every argument check, then the launcher reports
    # kUnsupported: RuntimeError carrying the message (fake pointers, never dereferenced).
    if mxflash.cuda_built():
        pytest.skip("needs a build without CUDA")
    qm, km, _, (q, k, v) = case

    def view(a, code):
        a = np.asarray(a)
        return (4096, code, _mxflash.DEVICE_CUDA, 0, list(a.shape), [s // a.itemsize for s in a.strides])

    def mx(t, o):
        return (view(t.payload, _mxflash.DTYPES["float8_e4m3fn"]), view(t.scales, _mxflash.DTYPES["uint8"]), o, 0, 0)

    To = sum(Q_LENGTHS)
    with raises_exactly(RuntimeError, "q.payload: CUDA tensors need a CUDA build"):
        _mxflash.attention_forward(qm._host, km._host, mx(q, 0), mx(k, 0), mx(v, 1), float("nan"), False,
                                   view(np.zeros((To, H, 128), BF16), _mxflash.DTYPES["bfloat16"]),
                                   view(np.zeros((H, To), np.float32), _mxflash.DTYPES["float32"]), 0, 0, 0)
    assert _mxflash.attention_forward_workspace_size(qm._host, km._host, H, False) == 0
    assert _mxflash.attention_backward_workspace_size(qm._host, km._host, H, False, False) == 0


# ---------------------------------------------------------------------------- CUDA


def torch_of(a, torch, device="cuda"):
    """numpy -> torch keeping the bytes (bf16 and fp8 through same-size integer views)."""
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).to(device).view(torch.bfloat16)
    if a.dtype == E4M3:
        return torch.from_numpy(a.view(np.uint8)).to(device).view(torch.float8_e4m3fn)
    return torch.from_numpy(a).to(device)


def mx_to(t, torch, device="cuda"):
    return mxflash.MxTensor(torch_of(t.payload, torch, device), torch_of(t.scales, torch, device), t.orientation,
                            t.scale_layout, t.payload_layout)


def compare_gpu_cpu(gpu, cpu, tag=""):
    go, gl = gpu
    co, cl = cpu
    go = go.float().cpu().numpy()
    gl = gl.cpu().numpy()
    co = co.astype(np.float32)
    empty = np.isneginf(cl[0])  # rows without keys
    assert np.all(np.isneginf(gl[:, empty])), f"{tag}: lse of rows without keys must be -inf"
    assert np.all(go[empty] == 0), f"{tag}: out of rows without keys must be 0"
    if (~empty).any():
        db = sqnr_db(co[~empty], go[~empty])
        assert db > 30, f"{tag}: GPU out SQNR {db:.1f} dB vs the CPU path"
        c, g = cl[:, ~empty], gl[:, ~empty]
        err = np.abs(g - c) / np.maximum(1.0, np.abs(c))
        assert np.all(np.isfinite(g)) and err.max() <= 1e-3, f"{tag}: lse relative error {err.max():.2e}"


GPU_Q_LENGTHS = [200, 0, 130, 1, 77, 128]
GPU_K_LENGTHS = [300, 5, 0, 129, 128, 1]


@pytest.mark.parametrize("scale_layout", ["plain", "blocked128x4"])
@pytest.mark.parametrize("v_payload_layout", ["token_major", "token_contiguous"])
def test_cuda_equals_cpu(torch_cuda, scale_layout, v_payload_layout):
    torch = torch_cuda
    qm, km = mxflash.JaggedMeta.from_lengths(GPU_Q_LENGTHS), mxflash.JaggedMeta.from_lengths(GPU_K_LENGTHS)
    xq, xk, xv = inputs(GPU_Q_LENGTHS, GPU_K_LENGTHS, seed=2)
    ops = mx_operands(xq, xk, xv, qm, km, scale_layout, v_payload_layout)
    cpu = mxflash.attention_forward(*ops, qm, km, softmax_scale=0.1)
    gpu = mxflash.attention_forward(*(mx_to(t, torch) for t in ops), qm, km, softmax_scale=0.1)
    assert gpu[0].is_cuda and gpu[0].dtype == torch.bfloat16 and tuple(gpu[0].shape) == cpu[0].shape
    assert gpu[1].is_cuda and gpu[1].dtype == torch.float32 and tuple(gpu[1].shape) == cpu[1].shape
    compare_gpu_cpu(gpu, cpu, f"{scale_layout}/{v_payload_layout}")


def test_cuda_broadcast_q_equals_cpu(torch_cuda):
    torch = torch_cuda
    k_lengths = [300, 0, 129, 1]
    qm, km = mxflash.JaggedMeta.from_lengths([150]), mxflash.JaggedMeta.from_lengths(k_lengths)
    xq, xk, xv = inputs([150], k_lengths, seed=3)
    ops = mx_operands(xq, xk, xv, qm, km)
    cpu = mxflash.attention_forward(*ops, qm, km, broadcast_q=True)
    gpu = mxflash.attention_forward(*(mx_to(t, torch) for t in ops), qm, km, broadcast_q=True)
    compare_gpu_cpu(gpu, cpu, "broadcast_q")


def launch_behind_sleep(torch, launch):
    """Runs launch((o, l)) on a fresh non-blocking stream behind ~0.1 s of GPU sleep, with o, l
    poisoned; asserts another stream still read the poison meanwhile (the launch queued on torch's
    current stream instead of running or writing at once). Returns (o, l) once the stream is done."""
    To = sum(Q_LENGTHS)
    o = torch.full((To, H, 128), -7.0, dtype=torch.bfloat16, device="cuda")
    l = torch.full((H, To), -7.0, dtype=torch.float32, device="cuda")
    # A first launch loads the kernels it runs: under CUDA's lazy loading (the default) a kernel's
    # first load may synchronize the context, which would wait out the sleep below on the host
    # before the launch is queued (seen once a shape class picked a kernel no earlier test had run).
    launch((torch.empty_like(o), torch.empty_like(l)))
    torch.cuda.synchronize()
    stream, other = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        launch((o, l))
    with torch.cuda.stream(other):
        early_o, early_l = o.cpu(), l.cpu()
    stream.synchronize()
    assert bool((early_o == -7.0).all()) and bool((early_l == -7.0).all()), (
        "outputs written before earlier work on torch's current stream finished: the launch did not "
        "enqueue asynchronously on that stream")
    return o, l


def test_cuda_runs_on_current_stream(torch_cuda):
    # The launches must queue behind work already on the current (non-blocking) stream: while that
    # stream sleeps, another stream still reads the untouched output buffers.
    torch = torch_cuda
    qm, km = mxflash.JaggedMeta.from_lengths(Q_LENGTHS), mxflash.JaggedMeta.from_lengths(K_LENGTHS)
    xq, xk, xv = inputs(Q_LENGTHS, K_LENGTHS)
    cpu = mxflash.attention_forward(*mx_operands(xq, xk, xv, qm, km), qm, km)
    # operands quantized on the GPU (the full torch path), metadata uploaded beforehand
    qm.upload()
    km.upload()
    ops = (mxflash.quantize_mx(torch_of(xq, torch), qm, "hdim"), mxflash.quantize_mx(torch_of(xk, torch), km, "hdim"),
           mxflash.quantize_mx(torch_of(xv, torch), km, "seq"))
    o, l = launch_behind_sleep(torch, lambda out: mxflash.attention_forward(*ops, qm, km, out=out))
    compare_gpu_cpu((o, l), cpu, "current stream")


def test_cuda_bad_arguments_write_nothing(torch_cuda):
    torch = torch_cuda
    qm, km = mxflash.JaggedMeta.from_lengths(Q_LENGTHS), mxflash.JaggedMeta.from_lengths(K_LENGTHS)
    xq, xk, xv = inputs(Q_LENGTHS, K_LENGTHS)
    q, k, v = (mx_to(t, torch) for t in mx_operands(xq, xk, xv, qm, km))
    To = sum(Q_LENGTHS)
    o = torch.full((To, H, 128), -7.0, dtype=torch.bfloat16, device="cuda")
    l = torch.full((H, To), -7.0, dtype=torch.float32, device="cuda")
    with raises_exactly(ValueError, "v.orientation: must be seq, got hdim"):
        mxflash.attention_forward(q, k, with_orientation(v, "hdim"), qm, km, out=(o, l))
    with raises_exactly(ValueError, "out: must be on the same device as q.payload (cuda:0), got cpu"):
        mxflash.attention_forward(q, k, v, qm, km, out=(o.cpu(), l))
    k_cpu = mxflash.MxTensor(k.payload.cpu(), k.scales.cpu(), "hdim")
    with raises_exactly(ValueError, "k.payload: must be on the same device as q.payload (cuda:0), got cpu"):
        mxflash.attention_forward(q, k_cpu, v, qm, km, out=(o, l))
    torch.cuda.synchronize()
    assert bool((o == -7.0).all()) and bool((l == -7.0).all())


def test_cuda_second_device(torch_cuda):
    torch = torch_cuda
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    qm, km = mxflash.JaggedMeta.from_lengths(Q_LENGTHS), mxflash.JaggedMeta.from_lengths(K_LENGTHS)
    xq, xk, xv = inputs(Q_LENGTHS, K_LENGTHS)
    ops = mx_operands(xq, xk, xv, qm, km)
    cpu = mxflash.attention_forward(*ops, qm, km)
    with torch.cuda.device(0):
        gpu = mxflash.attention_forward(*(mx_to(t, torch, "cuda:1") for t in ops), qm, km)
        assert torch.cuda.current_device() == 0
    assert gpu[0].device.index == 1 and gpu[1].device.index == 1
    torch.cuda.synchronize(1)
    compare_gpu_cpu(gpu, cpu, "cuda:1")
