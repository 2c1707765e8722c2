"""mxflash.gemm_quantize against a numpy oracle written here: y = dequantized(a) @ dequantized(w).T
in float64, rounded to float32 and quantized by the quantizer oracle of test_quantize.py; the coarse
path against the exact one in SQNR; the fused chain rmsnorm_quantize -> gemm_quantize against
float64; on CUDA the exact path's bytes equal the CPU's and the wgmma path tracks the CPU model of
its arithmetic. Bad arguments raise ValueError naming the argument, nothing written.
"""
import ml_dtypes
import numpy as np
import pytest

import mxflash
from test_codecs import scale_bytes
from test_quantize import quantize_elements

E4M3 = ml_dtypes.float8_e4m3fn


def mx_rows(x, mode="rceil"):
    """(payload uint8, scales uint8) of x (rows, K) quantized along K in blocks of 32 (the oracle)."""
    x = np.asarray(x, np.float32)
    R, K = x.shape
    blk = x.reshape(R, K // 32, 32)
    s = scale_bytes(np.max(np.abs(blk), axis=-1), mode)
    return quantize_elements(blk, s[..., None]).reshape(R, K), s


def deq(payload, scales):
    p = np.asarray(payload).view(np.uint8).view(E4M3).astype(np.float64)
    R, C = p.shape
    return (p.reshape(R, C // 32, 32) * np.exp2(scales.astype(np.float64) - 127)[..., None]).reshape(R, C)


def sqnr(ref, got):
    return 10 * np.log10(np.sum(ref * ref) / np.sum((got - ref) ** 2))


def operands(M, N, K, seed, spread=4):
    """MX a (M, K), w (N, K) from normal values whose 32-blocks vary over `spread` binades."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((M, K)) * np.exp2(rng.integers(0, spread + 1, (M, K // 32))).repeat(32, axis=1)
    w = rng.standard_normal((N, K)) * 0.05
    return mx_rows(a) + mx_rows(w)


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("shape", [(5, 32, 32), (33, 96, 160), (64, 384, 384)])
def test_exact_cpu_is_the_fp64_product_quantized(mode, shape):
    M, N, K = shape
    ap, asc, wp, wsc = operands(M, N, K, sum(shape))
    payload, scales = mxflash.gemm_quantize(ap, asc, wp, wsc, mode=mode, path="exact")
    assert payload.dtype == E4M3 and payload.shape == (M, N)
    assert scales.dtype == np.uint8 and scales.shape == (M, N // 32)
    y = (deq(ap, asc) @ deq(wp, wsc).T).astype(np.float32)
    p, s = mx_rows(y, mode)
    np.testing.assert_array_equal(scales, s)
    # fp64 sums in another order round a value sitting on an fp32 boundary the other way at most
    # a couple of times.
    assert np.count_nonzero(payload.view(np.uint8) != p) <= 2


def test_coarse_tracks_exact_and_auto_is_exact_on_cpu():
    ap, asc, wp, wsc = operands(64, 256, 384, 9, spread=6)
    ref = deq(ap, asc) @ deq(wp, wsc).T
    ep, es = mxflash.gemm_quantize(ap, asc, wp, wsc, path="exact")
    cp, cs = mxflash.gemm_quantize(ap, asc, wp, wsc, path="coarse")
    xp, xs = mxflash.gemm_quantize(ap, asc, wp, wsc)
    np.testing.assert_array_equal(xp.view(np.uint8), ep.view(np.uint8))
    np.testing.assert_array_equal(xs, es)
    se, sc = sqnr(ref, deq(ep, es)), sqnr(ref, deq(cp, cs))
    assert se > 28 and abs(se - sc) < 0.1, (se, sc)


def test_rmsnorm_then_gemm_tracks_fp64():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((200, 384)).astype(np.float32)
    W = (rng.standard_normal((384, 384)) / np.sqrt(384)).astype(np.float32)
    a, a_s, _ = mxflash.rmsnorm_quantize(x, None)
    wp, ws = mx_rows(W)
    yp, ys = mxflash.gemm_quantize(a, a_s, wp, ws, path="coarse")
    xd = x.astype(np.float64)
    ref = (xd / np.sqrt((xd * xd).mean(axis=1, keepdims=True) + 1e-6)) @ W.astype(np.float64).T
    assert sqnr(ref, deq(yp, ys)) > 23  # three e4m3 roundings (x, W, y): ~25 dB


@pytest.mark.parametrize("change,name", [
    (lambda a: a.update(w=a["w"][:, :64], w_scales=a["w_scales"][:, :2]), "w:"),
    (lambda a: a.update(a_scales=a["a_scales"][:, :2]), "a_scales:"),
    (lambda a: a.update(mode="ceil"), "mode:"),
    (lambda a: a.update(path="fast"), "path:"),
    (lambda a: a.update(a=a["a"].astype(np.float32)), "a:"),
])
def test_bad_arguments_name_the_argument_and_write_nothing(change, name):
    ap, asc, wp, wsc = operands(8, 64, 96, 1)
    args = dict(a=ap, a_scales=asc, w=wp, w_scales=wsc, mode="rceil", path="auto")
    change(args)
    out = (np.full((8, 64), 0xA5, np.uint8), np.full((8, 2), 0xA5, np.uint8))
    with pytest.raises(ValueError, match="^" + name):
        mxflash.gemm_quantize(args["a"], args["a_scales"], args["w"], args["w_scales"], mode=args["mode"],
                              path=args["path"], out=out)
    assert (out[0] == 0xA5).all() and (out[1] == 0xA5).all()


@pytest.mark.parametrize("shape", [(1000, 384, 384), (4099, 768, 384), (300, 128, 1024)])
def test_cuda_matches_cpu_on_both_paths(torch_cuda, shape):
    torch = torch_cuda
    M, N, K = shape
    ap, asc, wp, wsc = operands(M, N, K, M, spread=5)
    dev = [torch.from_numpy(np.ascontiguousarray(t)).cuda() for t in (ap, asc, wp, wsc)]
    for path in ("exact", "coarse"):
        cp, cs = mxflash.gemm_quantize(ap, asc, wp, wsc, path=path)
        gp, gs = mxflash.gemm_quantize(*dev, path=path)
        torch.cuda.synchronize()
        gp, gs = gp.view(torch.uint8).cpu().numpy(), gs.cpu().numpy()
        if path == "exact":
            np.testing.assert_array_equal(gp, cp.view(np.uint8))
            np.testing.assert_array_equal(gs, cs)
        else:  # the tensor cores' accumulation (test_gemm_gpu.cpp's nearly_same): small moves only
            assert np.all(np.abs(gs.astype(int) - cs.astype(int)) <= 1)
            unit = np.exp2(cs.astype(np.float64) - 127).repeat(32, axis=1)
            c = cp.view(np.uint8)
            adjacent = (gs.repeat(32, axis=1) == cs.repeat(32, axis=1)) & ((gp ^ c) & 0x80 == 0) & \
                (np.abs((gp & 0x7F).astype(int) - (c & 0x7F).astype(int)) == 1)
            rescaled = (gs != cs).repeat(32, axis=1)
            big = np.exp2(np.maximum(gs, cs).astype(np.float64) - 127).repeat(32, axis=1)
            diff = np.abs(deq(gp, gs) - deq(cp, cs))
            far = np.where(rescaled, diff > 448 * big / 8, diff > 448 * unit / 256)
            assert not np.any(far & ~adjacent)
            assert np.count_nonzero(gp != cp.view(np.uint8)) <= 0.02 * gp.size
    ref = deq(ap, asc) @ deq(wp, wsc).T
    assert abs(sqnr(ref, deq(gp, gs)) - sqnr(ref, deq(cp, cs))) < 0.01


def test_cuda_misaligned_coarse_is_named(torch_cuda):
    torch = torch_cuda
    ap, asc, wp, wsc = operands(256, 128, 128, 2)
    a = torch.zeros(256 * 128 + 16, dtype=torch.uint8, device="cuda")[1:256 * 128 + 1].view(256, 128)
    a.copy_(torch.from_numpy(ap))
    dev = [torch.from_numpy(t).cuda() for t in (asc, wp, wsc)]
    with pytest.raises(ValueError, match="^path:"):
        mxflash.gemm_quantize(a, dev[0], dev[1], dev[2], path="coarse")
    p, s = mxflash.gemm_quantize(a, *dev)  # auto: the exact kernel takes it
    cp, cs = mxflash.gemm_quantize(ap, asc, wp, wsc, path="exact")
    np.testing.assert_array_equal(p.view(torch.uint8).cpu().numpy(), cp.view(np.uint8))
