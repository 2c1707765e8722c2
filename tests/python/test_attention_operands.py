"""mxflash.quantize_attention_forward and mxflash.attention_forward_operands: the forward's operands
in the kernel's execution layout. CPU (numpy): shapes and dtypes, padding bytes, the forward on them
against the MX-operand forward on the same inputs, bf16 and float32 inputs giving the same bytes,
out= arguments, bad arguments (ValueError with the C++ message naming the argument, outputs
untouched). CUDA: the GPU operands byte for byte against the CPU ones, the GPU forward on them
against the CPU forward, the current stream. CUDA tests skip, saying why, without torch, a CUDA
device, a CUDA build or an sm_90 device (MXFLASH_REQUIRE_CUDA=1 turns those skips into failures)."""
import importlib.util
import re

import ml_dtypes
import numpy as np
import pytest

import mxflash
from test_attention import launch_behind_sleep, torch_of

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
H = 2
Q_LENGTHS = [40, 0, 70]
K_LENGTHS = [33, 5, 0]  # sequence 2 has queries but no keys; sequence 1 keys but no queries
NAMES = ("q", "q_scale", "k", "k_scale", "v", "v_scale")
GPU_Q_LENGTHS = [200, 0, 130, 1, 77, 128]
GPU_K_LENGTHS = [300, 5, 0, 129, 128, 1]


# ---------------------------------------------------------------------------- helpers
def inputs(q_lengths, k_lengths, heads=H, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    tq, tk = sum(q_lengths), sum(k_lengths)
    return tuple(rng.standard_normal((t, heads, 128)).astype(np.float32).astype(dtype) for t in (tq, tk, tk))


def metas(q_lengths=Q_LENGTHS, k_lengths=K_LENGTHS):
    return mxflash.JaggedMeta.from_lengths(q_lengths), mxflash.JaggedMeta.from_lengths(k_lengths)


def mx_forward(xq, xk, xv, qm, km, **kw):
    """The MX-operand forward (three quantize_mx, attention_forward) on the same inputs."""
    ops = (mxflash.quantize_mx(xq, qm, "hdim"), mxflash.quantize_mx(xk, km, "hdim"), mxflash.quantize_mx(xv, km, "seq"))
    return mxflash.attention_forward(*ops, qm, km, **kw)


def sqnr_db(ref, x):
    ref, x = np.asarray(ref, np.float64), np.asarray(x, np.float64)
    err = np.sum((x - ref) ** 2)
    return np.inf if err == 0 else 10 * np.log10(np.sum(ref ** 2) / err)


def raw(a):
    """The bytes of an array (numpy or torch, any device) as a flat uint8 numpy array."""
    if not isinstance(a, np.ndarray):
        import torch
        a = a.detach().cpu().contiguous().view(torch.uint8).numpy()
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def raises_exactly(exc, message):
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


def sentinel(shape, dtype):
    """An array of dtype filled with 0xAB bytes."""
    return np.full(tuple(shape) + (np.dtype(dtype).itemsize,), 0xAB, np.uint8).view(dtype).reshape(shape)


def untouched(*arrays):
    return all(bool((raw(a) == 0xAB).all()) for a in arrays)


def sentinel_operands(qm, km, heads=H):
    shapes = mxflash.attention_fwd_operand_shapes(qm, km, heads)
    return mxflash.AttentionFwdOperands(*(sentinel(shapes[n], E4M3 if n in ("q", "k", "v") else np.float32)
                                          for n in NAMES))


def replaced(ops, **change):
    arrays = {n: getattr(ops, n) for n in NAMES}
    arrays.update(change)
    return mxflash.AttentionFwdOperands(**arrays)


def compare_outputs(got, want, tag, min_db=40.0, lse_tol=1e-5):
    """out SQNR above min_db and lse relative error at most lse_tol on rows with keys; rows without
    keys: out 0 and lse -inf in both."""
    go, gl = (np.asarray(x.float().cpu() if not isinstance(x, np.ndarray) else x, np.float32) for x in got)
    wo, wl = (np.asarray(x, np.float32) for x in want)
    empty = np.isneginf(wl[0])
    assert np.all(np.isneginf(gl[:, empty])) and np.all(go[empty] == 0), f"{tag}: rows without keys"
    if (~empty).any():
        db = sqnr_db(wo[~empty], go[~empty])
        assert db > min_db, f"{tag}: out SQNR {db:.1f} dB"
        c, g = wl[:, ~empty], gl[:, ~empty]
        err = np.abs(g - c) / np.maximum(1.0, np.abs(c))
        assert np.all(np.isfinite(g)) and err.max() <= lse_tol, f"{tag}: lse relative error {err.max():.2e}"


@pytest.fixture(scope="module")
def case():
    qm, km = metas()
    x = inputs(Q_LENGTHS, K_LENGTHS)
    return qm, km, x, mxflash.quantize_attention_forward(*x, qm, km)


# ---------------------------------------------------------------------------- CPU
def test_operand_shapes_and_dtypes(case):
    qm, km, _, ops = case
    Pq, Pk = qm.padded_tokens, km.padded_tokens
    assert (Pq, Pk) == (256, 256)
    want = {"q": (H, Pq, 128), "q_scale": (H, Pq), "k": (H, Pk, 128), "k_scale": (H, Pk // 128),
            "v": (H, 128, Pk), "v_scale": (H, Pk // 128)}
    assert mxflash.attention_fwd_operand_shapes(qm, km, H) == want
    assert isinstance(ops, mxflash.AttentionFwdOperands)
    for n in NAMES:
        a = getattr(ops, n)
        assert isinstance(a, np.ndarray) and a.shape == want[n], n
        assert a.dtype == (E4M3 if n in ("q", "k", "v") else np.float32), n
    assert [a is getattr(ops, n) for a, n in zip(ops, NAMES)] == [True] * 6  # iterates in field order
    assert "v_scale=ndarray(2, 2) float32" in repr(ops)
    # broadcast_q metadata: one Q sequence, three K/V sequences
    s = mxflash.attention_fwd_operand_shapes(*metas([37], [33, 129, 0]), 3)
    assert s["q"] == (3, 128, 128) and s["k_scale"] == (3, 3) and s["v"] == (3, 128, 384)
    with raises_exactly(ValueError, "heads: must be >= 1"):
        mxflash.attention_fwd_operand_shapes(qm, km, 0)
    with pytest.raises(TypeError, match="^k_meta: expected mxflash.JaggedMeta, got list$"):
        mxflash.attention_fwd_operand_shapes(qm, K_LENGTHS, H)


def test_every_byte_written_and_padding_zero(case):
    qm, km, x, ops = case
    out = sentinel_operands(qm, km)
    assert mxflash.quantize_attention_forward(*x, qm, km, out=out) is out
    for n in NAMES:
        assert np.array_equal(raw(getattr(out, n)), raw(getattr(ops, n))), n
    # padding tokens: zero payload bytes, q_scale 1
    q_pad = np.ones(qm.padded_tokens, bool)
    for s, n in zip(qm.cu_seqlens_sf[:-1], qm.lengths):
        q_pad[s:s + n] = False
    k_pad = np.ones(km.padded_tokens, bool)
    for s, n in zip(km.cu_seqlens_sf[:-1], km.lengths):
        k_pad[s:s + n] = False
    assert q_pad.sum() == 256 - 110 and k_pad.sum() == 256 - 38
    assert not raw(out.q.view(np.uint8)[:, q_pad]).any() and np.all(out.q_scale[:, q_pad] == 1)
    assert not raw(out.k.view(np.uint8)[:, k_pad]).any()
    # V's tokens are permuted within 32-groups only: whole padding 32-groups are zero
    groups = k_pad.reshape(-1, 32).all(axis=1)
    assert not raw(out.v.view(np.uint8).reshape(H, 128, -1, 32)[:, :, groups]).any()
    # scales are positive powers of two
    for n in ("q_scale", "k_scale", "v_scale"):
        s = getattr(out, n)
        assert np.all(s > 0) and np.all(np.frexp(s)[0] == 0.5), n


@pytest.mark.parametrize("softmax_scale", [None, 0.3])
def test_forward_on_operands_matches_mx_forward(case, softmax_scale):
    qm, km, x, ops = case
    got = mxflash.attention_forward_operands(ops, qm, km, softmax_scale=softmax_scale)
    want = mx_forward(*x, qm, km, softmax_scale=softmax_scale)
    To = sum(Q_LENGTHS)
    assert got[0].dtype == BF16 and got[0].shape == (To, H, 128)
    assert got[1].dtype == np.float32 and got[1].shape == (H, To)
    compare_outputs(got, want, f"softmax_scale={softmax_scale}")
    assert np.isneginf(got[1][:, 40:]).all() and (got[0][40:].astype(np.float32) == 0).all()


def test_broadcast_q_matches_mx_forward():
    lq, k_lengths = 37, [33, 5, 0, 150]
    qm, km = metas([lq], k_lengths)
    x = inputs([lq], k_lengths, seed=1)
    ops = mxflash.quantize_attention_forward(*x, qm, km)
    got = mxflash.attention_forward_operands(ops, qm, km, broadcast_q=True)
    assert got[0].shape == (len(k_lengths) * lq, H, 128) and got[1].shape == (H, len(k_lengths) * lq)
    compare_outputs(got, mx_forward(*x, qm, km, broadcast_q=True), "broadcast_q")


def test_bf16_and_float32_inputs_give_identical_bytes():
    qm, km = metas()
    x16 = inputs(Q_LENGTHS, K_LENGTHS, seed=4, dtype=BF16)
    x32 = tuple(a.astype(np.float32) for a in x16)
    a, b = (mxflash.quantize_attention_forward(*x, qm, km) for x in (x16, x32))
    for n in NAMES:
        assert np.array_equal(raw(getattr(a, n)), raw(getattr(b, n))), n


def test_three_heads_and_one_key_tile_boundary():
    q_lengths, k_lengths = [129, 3], [128, 257]
    qm, km = metas(q_lengths, k_lengths)
    x = inputs(q_lengths, k_lengths, heads=3, seed=5)
    ops = mxflash.quantize_attention_forward(*x, qm, km)
    assert ops.k_scale.shape == (3, km.padded_tokens // 128)
    compare_outputs(mxflash.attention_forward_operands(ops, qm, km), mx_forward(*x, qm, km), "3 heads")


def test_forward_out_argument_is_written_and_returned(case):
    qm, km, _, ops = case
    To = sum(Q_LENGTHS)
    o, l = sentinel((To, H, 128), BF16), sentinel((H, To), np.float32)
    ro, rl = mxflash.attention_forward_operands(ops, qm, km, out=(o, l))
    assert ro is o and rl is l
    want = mxflash.attention_forward_operands(ops, qm, km)
    assert np.array_equal(raw(o), raw(want[0])) and np.array_equal(l, want[1])


def test_torch_cpu_tensors_use_the_reference(case):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import torch
    qm, km, x, ops = case
    tops = mxflash.quantize_attention_forward(*(torch.from_numpy(a) for a in x), qm, km)
    assert isinstance(tops.q, torch.Tensor) and tops.q.dtype == torch.float8_e4m3fn
    assert tops.v_scale.dtype == torch.float32
    for n in NAMES:
        assert np.array_equal(raw(getattr(tops, n)), raw(getattr(ops, n))), n
    out, lse = mxflash.attention_forward_operands(tops, qm, km)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want = mxflash.attention_forward_operands(ops, qm, km)
    assert np.array_equal(raw(out), raw(want[0])) and np.array_equal(lse.numpy(), want[1])


# ---------------------------------------------------------------------------- bad arguments
def non_contiguous(a):
    return np.ascontiguousarray(np.swapaxes(a, 0, 1)).swapaxes(0, 1)


def bad_operand_cases(ops):
    To = sum(Q_LENGTHS)
    return [
        (dict(v_scale=ops.v_scale.view(np.uint8)), "ops.v_scale: dtype must be float32, got uint8"),
        (dict(v_scale=ops.v_scale.astype(BF16)), "ops.v_scale: dtype must be float32, got bfloat16"),
        (dict(q_scale=ops.q_scale.view(np.int32)), "ops.q_scale: dtype must be float32, got int32"),
        (dict(k=ops.k.view(np.uint8).view(BF16)), "ops.k: dtype must be float8_e4m3fn or uint8, got bfloat16"),
        (dict(k_scale=ops.k_scale[:, :1].copy()), "ops.k_scale: shape must be (2, 2), got (2, 1)"),
        (dict(v=ops.v[:, :, :128].copy()), "ops.v: shape must be (2, 128, 256), got (2, 128, 128)"),
        (dict(v_scale=ops.v_scale.reshape(H, -1, 1)), "ops.v_scale: shape must be (2, 2), got (2, 2, 1)"),
        (dict(q=ops.q[:1].copy()),
         "ops.k: has 2 heads, which must divide ops.q's 1 (the same count, or a grouped-query share of it)"),
        (dict(k=ops.k[:1].copy()), "ops.k_scale: shape must be (1, 2), got (2, 2)"),
        (dict(q=non_contiguous(ops.q)), "ops.q: must be contiguous (row-major, no gaps)"),
        (dict(out=(sentinel((To, H, 128), np.float32), None)), "out: dtype must be bfloat16, got float32"),
        (dict(out=(None, sentinel((To, H), np.float32))), f"lse: shape must be ({H}, {To}), got ({To}, {H})"),
        (dict(broadcast_q=True), "q_meta: broadcast_q needs exactly one Q sequence, got 3"),
        (dict(softmax_scale=float("inf")), "softmax_scale: must be a finite positive number"),
    ]


def test_bad_operands_raise_the_library_message_and_write_nothing(case):
    qm, km, _, ops = case
    To = sum(Q_LENGTHS)
    for change, message in bad_operand_cases(ops):
        kw = {k: change.pop(k) for k in ("broadcast_q", "softmax_scale", "out") if k in change}
        o, l = kw.pop("out", (None, None))
        o = sentinel((To, H, 128), BF16) if o is None else o
        l = sentinel((H, To), np.float32) if l is None else l
        with raises_exactly(ValueError, message):
            mxflash.attention_forward_operands(replaced(ops, **change), qm, km, out=(o, l), **kw)
        assert untouched(o, l), f"outputs written although the call failed with {message!r}"


def test_bad_quantizer_inputs_raise_and_write_nothing(case):
    qm, km, (xq, xk, xv), ops = case
    cases = [
        ((xq, xk.astype(BF16), xv), "k: dtype must be float32, got bfloat16"),
        ((xq.astype(BF16), xk, xv.astype(BF16)), "k: dtype must be bfloat16, got float32"),
        ((xq.astype(np.float16), xk, xv), "q: dtype must be bfloat16 or float32, got float16"),
        ((xq[:100], xk, xv), "q: shape must be (110, 2, 128), got (100, 2, 128)"),
        ((xq, xk, xv[:, :, :64].copy()), "v: shape must be (38, 2, 128), got (38, 2, 64)"),
        ((xq, xk[:, :1].copy(), xv), "v: shape must be (38, 1, 128), got (38, 2, 128)"),
        ((xq.reshape(110, 256), xk, xv), "q: must be 3-D (Tq, H, 128), got (110, 256)"),
        ((xq, non_contiguous(xk), xv), "k: must be contiguous (row-major, no gaps)"),
    ]
    for args, message in cases:
        out = sentinel_operands(qm, km)
        with raises_exactly(ValueError, message):
            mxflash.quantize_attention_forward(*args, qm, km, out=out)
        assert untouched(*out), f"operands written although the call failed with {message!r}"
    # a bad out= operand is named as the library names it
    out = replaced(sentinel_operands(qm, km), v_scale=sentinel(ops.v_scale.shape, np.float64))
    with pytest.raises(ValueError, match=r"^ops.v_scale: dtype float64 is not supported"):
        mxflash.quantize_attention_forward(xq, xk, xv, qm, km, out=out)
    out = replaced(sentinel_operands(qm, km), q_scale=sentinel((H, 128), np.float32))
    with raises_exactly(ValueError, "ops.q_scale: shape must be (2, 256), got (2, 128)"):
        mxflash.quantize_attention_forward(xq, xk, xv, qm, km, out=out)
    assert untouched(out.q, out.k, out.v)
    with raises_exactly(ValueError, "ops.q: has 3 heads, q has 2"):
        mxflash.quantize_attention_forward(xq, xk, xv, qm, km, out=sentinel_operands(qm, km, heads=3))


def test_python_level_type_errors(case):
    qm, km, (xq, xk, xv), ops = case
    with pytest.raises(TypeError, match="^ops: expected mxflash.AttentionFwdOperands"):
        mxflash.attention_forward_operands(tuple(ops), qm, km)
    with pytest.raises(TypeError, match="^out: expected mxflash.AttentionFwdOperands"):
        mxflash.quantize_attention_forward(xq, xk, xv, qm, km, out=tuple(ops))
    with pytest.raises(TypeError, match="^q_meta: expected mxflash.JaggedMeta, got list$"):
        mxflash.quantize_attention_forward(xq, xk, xv, Q_LENGTHS, km)
    with pytest.raises(TypeError, match="^k_meta: expected mxflash.JaggedMeta, got list$"):
        mxflash.attention_forward_operands(ops, qm, K_LENGTHS)
    with pytest.raises(TypeError, match="^v: expected a numpy array"):
        mxflash.quantize_attention_forward(xq, xk, xv.tolist(), qm, km)
    with pytest.raises(TypeError, match="^ops.k_scale: expected a numpy array"):
        mxflash.attention_forward_operands(replaced(ops, k_scale=None), qm, km)
    with raises_exactly(ValueError, "out: must be a tuple (out, lse)"):
        mxflash.attention_forward_operands(ops, qm, km, out=np.zeros(3))


def test_non_invalid_status_is_runtime_error(case):
    # In a CPU-only build CUDA views pass every argument check, then the launchers report
    # kUnsupported: RuntimeError carrying the message (fake pointers, never dereferenced).
    if mxflash.cuda_built():
        pytest.skip("needs a build without CUDA")
    from mxflash import _mxflash
    qm, km, x, ops = case

    def view(a):
        return (4096, _mxflash.DTYPES[a.dtype.name], _mxflash.DEVICE_CUDA, 0, list(a.shape),
                [st // a.itemsize for st in a.strides])

    To = sum(Q_LENGTHS)
    with raises_exactly(RuntimeError, "q: CUDA tensors need a CUDA build"):
        _mxflash.quantize_attention_forward(qm._host, km._host, *(view(a) for a in x),
                                            tuple(view(a) for a in ops), 0)
    with raises_exactly(RuntimeError, "ops.q: CUDA tensors need a CUDA build"):
        _mxflash.attention_forward_operands(qm._host, km._host, tuple(view(a) for a in ops), float("nan"), False,
                                            view(np.zeros((To, H, 128), BF16)),
                                            view(np.zeros((H, To), np.float32)), 0, 0, 0)
    assert _mxflash.attention_forward_operands_workspace_size(qm._host, km._host, H, False) == 0


def test_operands_workspace_is_the_work_list_only(case):
    if not mxflash.cuda_built():
        pytest.skip("needs a CUDA build (the size is 0 without one)")
    from mxflash import _mxflash
    qm, km, _, _ = case
    n = _mxflash.attention_forward_operands_workspace_size(qm._host, km._host, H, False)
    q_tiles = sum((lq + 127) // 128 for lq in Q_LENGTHS)
    assert n == ((q_tiles + 1) * 8 + 255) // 256 * 256  # the work list and the persistent kernels' item counter
    assert n < _mxflash.attention_forward_workspace_size(qm._host, km._host, H, False)
    assert _mxflash.attention_forward_operands_workspace_size(qm._host, km._host, H, True) == 0  # 3 Q sequences


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lengths", ["jagged", "broadcast"])
def test_cuda_operands_equal_cpu_operands(torch_cuda, dtype, lengths):
    torch = torch_cuda
    q_lengths, k_lengths = (GPU_Q_LENGTHS, GPU_K_LENGTHS) if lengths == "jagged" else ([150], [300, 0, 129, 1])
    qm, km = metas(q_lengths, k_lengths)
    x = inputs(q_lengths, k_lengths, heads=3, seed=6, dtype=BF16 if dtype == "bfloat16" else np.float32)
    cpu = mxflash.quantize_attention_forward(*x, qm, km)
    gpu = mxflash.quantize_attention_forward(*(torch_of(a, torch) for a in x), qm, km)
    for n in NAMES:
        g = getattr(gpu, n)
        assert g.is_cuda and tuple(g.shape) == getattr(cpu, n).shape, n
        assert np.array_equal(raw(g), raw(getattr(cpu, n))), f"{dtype}/{lengths}: {n} differs from the CPU bytes"


@pytest.mark.parametrize("broadcast_q", [False, True])
def test_cuda_forward_on_operands_equals_cpu(torch_cuda, broadcast_q):
    torch = torch_cuda
    q_lengths, k_lengths = ([150], [300, 0, 129, 1]) if broadcast_q else (GPU_Q_LENGTHS, GPU_K_LENGTHS)
    qm, km = metas(q_lengths, k_lengths)
    x = inputs(q_lengths, k_lengths, seed=7)
    ops = mxflash.quantize_attention_forward(*x, qm, km)
    cpu = mxflash.attention_forward_operands(ops, qm, km, softmax_scale=0.1, broadcast_q=broadcast_q)
    gops = mxflash.AttentionFwdOperands(*(torch_of(a, torch) for a in ops))
    gpu = mxflash.attention_forward_operands(gops, qm, km, softmax_scale=0.1, broadcast_q=broadcast_q)
    assert gpu[0].is_cuda and gpu[0].dtype == torch.bfloat16 and tuple(gpu[0].shape) == cpu[0].shape
    assert gpu[1].is_cuda and gpu[1].dtype == torch.float32 and tuple(gpu[1].shape) == cpu[1].shape
    compare_outputs(gpu, cpu, f"GPU vs CPU, broadcast_q={broadcast_q}", min_db=30, lse_tol=1e-3)
    # and the GPU forward on operands against the GPU forward on MX tensors
    gx = [torch_of(a, torch) for a in x]
    mx = mx_forward(*gx, qm, km, softmax_scale=0.1, broadcast_q=broadcast_q)
    compare_outputs(gpu, (mx[0].float().cpu().numpy(), mx[1].cpu().numpy()),
                    f"operands vs MX on the GPU, broadcast_q={broadcast_q}", min_db=30, lse_tol=1e-3)


def test_cuda_runs_on_current_stream(torch_cuda):
    # quantize and forward must queue behind work already on the current (non-blocking) stream
    torch = torch_cuda
    qm, km = metas()
    x = inputs(Q_LENGTHS, K_LENGTHS)
    cpu = mxflash.attention_forward_operands(mxflash.quantize_attention_forward(*x, qm, km), qm, km)
    qm.upload()
    km.upload()
    gx = [torch_of(a, torch) for a in x]
    o, l = launch_behind_sleep(torch, lambda out: mxflash.attention_forward_operands(
        mxflash.quantize_attention_forward(*gx, qm, km), qm, km, out=out))
    compare_outputs((o, l), cpu, "current stream", min_db=30, lse_tol=1e-3)


def test_cuda_bad_arguments_write_nothing(torch_cuda):
    torch = torch_cuda
    qm, km = metas()
    x = inputs(Q_LENGTHS, K_LENGTHS)
    ops = mxflash.AttentionFwdOperands(*(torch_of(a, torch) for a in mxflash.quantize_attention_forward(*x, qm, km)))
    To = sum(Q_LENGTHS)
    o = torch.full((To, H, 128), -7.0, dtype=torch.bfloat16, device="cuda")
    l = torch.full((H, To), -7.0, dtype=torch.float32, device="cuda")
    with raises_exactly(ValueError, "ops.v_scale: dtype must be float32, got uint8"):
        mxflash.attention_forward_operands(replaced(ops, v_scale=ops.v_scale.view(torch.uint8)), qm, km, out=(o, l))
    with pytest.raises(ValueError, match=r"^ops.k_scale: must be on the same device as ops.q \(cuda:0\), got cpu"):
        mxflash.attention_forward_operands(replaced(ops, k_scale=ops.k_scale.cpu()), qm, km, out=(o, l))
    with pytest.raises(ValueError, match=r"^out: must be on the same device as ops.q \(cuda:0\), got cpu"):
        mxflash.attention_forward_operands(ops, qm, km, out=(o.cpu(), l))
    torch.cuda.synchronize()
    assert bool((o == -7.0).all()) and bool((l == -7.0).all())
    gx = [torch_of(a, torch) for a in x]
    with raises_exactly(ValueError, "k: dtype must be float32, got bfloat16"):
        mxflash.quantize_attention_forward(gx[0], gx[1].to(torch.bfloat16), gx[2], qm, km)
