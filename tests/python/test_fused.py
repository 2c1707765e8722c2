"""mxflash.rmsnorm_quantize against a numpy oracle written here: rstd against float64, the bytes
against the quantizer oracle of test_quantize.py applied to y = (x * rstd) * weight in fp32 (the
value the operation defines), and on CUDA the bytes of the CPU path, plus torch's own RMSNorm as
the user would compare. Bad arguments raise ValueError naming the argument, nothing written.
"""
import ml_dtypes
import numpy as np
import pytest

import mxflash
from test_codecs import scale_bytes
from test_quantize import quantize_elements

BF16 = ml_dtypes.bfloat16


def rows(T, C, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    sigma = np.exp2(rng.uniform(-12, 12, size=(T, 1)))
    return (rng.standard_normal((T, C)) * sigma).astype(np.float32).astype(dtype)


def oracle(x, w, rstd, mode):
    """payload, scales of y = (x * rstd) * w in fp32, blocks of 32 along the row."""
    xf = np.asarray(x).astype(np.float32)
    y = (xf * rstd[:, None]).astype(np.float32)
    if w is not None:
        y = (y * np.asarray(w).astype(np.float32)[None, :]).astype(np.float32)
    T, C = y.shape
    blk = y.reshape(T, C // 32, 32)
    scales = scale_bytes(np.max(np.abs(blk), axis=-1), mode)
    payload = quantize_elements(blk, scales[..., None]).reshape(T, C)
    payload[np.isnan(y)] = 0x7F
    return payload, scales


@pytest.mark.parametrize("C", [32, 96, 384, 2080, 4096])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("dtypes", [(BF16, np.float32), (np.float32, BF16), (BF16, None)])
def test_cpu_matches_fp64_and_the_oracle(C, mode, dtypes):
    xdt, wdt = dtypes
    x = rows(7, C, C, xdt)
    w = None if wdt is None else (1 + 0.3 * np.random.default_rng(1).standard_normal(C)).astype(wdt)
    payload, scales, rstd = mxflash.rmsnorm_quantize(x, w, eps=1e-5, mode=mode)
    assert payload.dtype == ml_dtypes.float8_e4m3fn and payload.shape == (7, C)
    assert scales.dtype == np.uint8 and scales.shape == (7, C // 32)
    assert rstd.dtype == np.float32 and rstd.shape == (7,)
    xd = x.astype(np.float64)
    want = 1 / np.sqrt((xd * xd).mean(axis=1) + np.float32(1e-5))
    np.testing.assert_allclose(rstd, want, rtol=(C / 32 + 8) * 2.0**-24)
    p, s = oracle(x, w, rstd, mode)
    np.testing.assert_array_equal(scales, s)
    np.testing.assert_array_equal(payload.view(np.uint8), p)


def test_equals_the_hdim_quantizer_of_its_rows():
    x = rows(33, 384, 3, BF16)
    w = np.linspace(0.5, 1.5, 384, dtype=np.float32)
    payload, scales, rstd = mxflash.rmsnorm_quantize(x, w)
    y = (x.astype(np.float32) * rstd[:, None]).astype(np.float32) * w[None, :]
    meta = mxflash.JaggedMeta.from_lengths([33])
    qp, qs = mxflash.quantize(y.astype(np.float32).reshape(33, 3, 128), meta, "hdim")
    np.testing.assert_array_equal(payload.view(np.uint8), qp.view(np.uint8).reshape(33, 384))
    np.testing.assert_array_equal(scales, qs.reshape(33, 12))


def test_nonfinite_rows_and_no_rstd():
    x = rows(3, 64, 9)
    x[0, 5] = np.nan
    x[1, 7] = -np.inf
    x[2, :] = 0
    payload, scales, rstd = mxflash.rmsnorm_quantize(x, None, eps=0.0, rstd=False)
    assert rstd is None
    b = payload.view(np.uint8)
    assert (b[0] == 0x7F).all() and (scales[0] == 255).all()
    assert b[1, 7] == 0x7F and ((b[1, :] & 0x7F) == 0).sum() == 63 and list(scales[1]) == [255, 0]
    assert (b[2] == 0x7F).all()  # 0 * 1/sqrt(0) = NaN, as in torch with eps 0


@pytest.mark.parametrize("change, name", [
    (lambda a: a.update(x=np.zeros((4, 48), np.float32)), "x:"),
    (lambda a: a.update(x=np.zeros((4, 2, 64), np.float32)), "x:"),
    (lambda a: a.update(weight=np.zeros(96, np.float32)), "weight:"),
    (lambda a: a.update(weight=np.zeros(128, np.float16)), "weight:"),
    (lambda a: a.update(eps=-1.0), "eps:"),
    (lambda a: a.update(eps=float("nan")), "eps:"),
    (lambda a: a.update(mode="ceil"), "mode:"),
])
def test_bad_arguments_name_the_argument_and_write_nothing(change, name):
    args = dict(x=np.ones((4, 128), np.float32), weight=np.ones(128, np.float32), eps=1e-6, mode="rceil")
    change(args)
    out = (np.full((4, 128), 0xA5, np.uint8), np.full((4, 4), 0xA5, np.uint8), np.full(4, np.nan, np.float32))
    if args["x"].ndim != 2 or args["x"].shape[1] != 128:
        out = None
    with pytest.raises(ValueError, match="^" + name):
        mxflash.rmsnorm_quantize(args["x"], args["weight"], eps=args["eps"], mode=args["mode"], out=out)
    if out is not None:
        assert (out[0] == 0xA5).all() and (out[1] == 0xA5).all() and np.isnan(out[2]).all()


@pytest.mark.parametrize("C", [384, 512, 2048, 4096])
def test_cuda_equals_cpu_and_tracks_torch_rms_norm(torch_cuda, C):
    torch = torch_cuda
    x = rows(1000, C, C, BF16)
    w = (1 + 0.3 * np.random.default_rng(2).standard_normal(C)).astype(np.float32)
    cp, cs, cr = mxflash.rmsnorm_quantize(x, w, eps=1e-6)
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
    wt = torch.from_numpy(w).cuda()
    gp, gs, gr = mxflash.rmsnorm_quantize(xt, wt, eps=1e-6)
    torch.cuda.synchronize()
    assert gp.dtype == torch.float8_e4m3fn and gp.device == xt.device
    np.testing.assert_array_equal(gp.view(torch.uint8).cpu().numpy(), cp.view(np.uint8))
    np.testing.assert_array_equal(gs.cpu().numpy(), cs)
    np.testing.assert_array_equal(gr.cpu().numpy().view(np.uint32), cr.view(np.uint32))
    # What a user compares with: torch's RMSNorm in fp32, against our dequantized y.
    ref = torch.nn.functional.rms_norm(xt.float(), (C,), wt, eps=1e-6)
    deq = (gp.float().view(1000, C // 32, 32) * torch.exp2(gs.float() - 127)[..., None]).view(1000, C)
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (deq - ref).pow(2).sum()).item()
    assert sqnr > 28, sqnr  # e4m3 element rounding: ~31 dB on normal rows (a lost weight: ~10)


def test_cuda_bad_pointer_is_named(torch_cuda):
    torch = torch_cuda
    x = torch.zeros(4 * 128 + 8, dtype=torch.bfloat16, device="cuda")[1:4 * 128 + 1].view(4, 128)  # 2 bytes off
    with pytest.raises(ValueError, match="^x:"):
        mxflash.rmsnorm_quantize(x, None)
