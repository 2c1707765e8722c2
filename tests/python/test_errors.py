"""Bad arguments raise ValueError carrying the C++ library's message (naming the argument), and
nothing is written. CUDA cases (torch tensors on the GPU, mixed CPU/CUDA arguments) skip without
torch, a CUDA device or a CUDA build (MXFLASH_REQUIRE_CUDA=1 turns those skips into failures)."""
import re

import ml_dtypes
import numpy as np
import pytest

import mxflash
from mxflash import _mxflash

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
LENGTHS = [17, 0, 129]  # T = 146, P = 384
H = 2


@pytest.fixture
def meta():
    return mxflash.JaggedMeta.from_lengths(LENGTHS)


@pytest.fixture
def x():
    return np.random.default_rng(0).standard_normal((146, H, 128)).astype(BF16)


def raises_exactly(exc, message):
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


def sentinel(shape, dtype=np.uint8):
    return np.full(shape, 0xAB, np.uint8).view(dtype)


def untouched(*arrays):
    return all(bool((np.asarray(a).view(np.uint8) == 0xAB).all()) for a in arrays)


# ---------------------------------------------------------------------------- quantize: x
@pytest.mark.parametrize("make,message", [
    (lambda x: x.astype(np.int32), "x: dtype must be bfloat16 or float32, got int32"),
    (lambda x: x.astype(np.float16), "x: dtype must be bfloat16 or float32, got float16"),
    (lambda x: x.reshape(146, 256), "x: must be 3-D (T, H, 128), got (146, 256)"),
    (lambda x: x.reshape(146, 4, 64), "x: head dim (last axis) must be 128, got 64"),
    (lambda x: np.concatenate([x, x[:1]]), "x: token count (axis 0) is 147 but meta holds 146 tokens"),
    (lambda x: x[:, :, :][:, ::-1], "x: must be contiguous (row-major, no gaps)"),
    (lambda x: np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2),
     "x: must be contiguous (row-major, no gaps)"),
])
def test_bad_x(meta, x, make, message):
    with raises_exactly(ValueError, message):
        mxflash.quantize(make(x), meta)


def test_dtype_without_library_equivalent_names_the_argument(meta, x):
    with pytest.raises(ValueError, match="^x: dtype float64 is not supported"):
        mxflash.quantize(x.astype(np.float64), meta)
    with pytest.raises(ValueError, match="^x: must have at most 4 dimensions, got 5$"):
        mxflash.quantize(x.reshape(146, 2, 1, 1, 128), meta)


def test_wrong_python_types(meta, x):
    with pytest.raises(TypeError, match="^meta: expected mxflash.JaggedMeta, got list$"):
        mxflash.quantize(x, LENGTHS)
    with pytest.raises(TypeError, match="^x: expected a numpy array"):
        mxflash.quantize(x.tolist(), meta)


# ---------------------------------------------------------------------------- quantize: options
@pytest.mark.parametrize("kwargs,message", [
    (dict(orientation="rows"), "orientation: must be hdim, seq or square32"),
    (dict(orientation=None), "orientation: must be hdim, seq or square32"),
    (dict(mode="ceil"), "mode: must be rceil or floor"),
    (dict(scale_layout="blocked"), "scale_layout: must be plain or blocked128x4"),
    (dict(orientation="seq", payload_layout="contiguous"), "payload_layout: must be token_major or token_contiguous"),
    (dict(payload_layout="token_contiguous"),
     "payload_layout: hdim payloads are token_major only (token_contiguous is for seq and square32)"),
])
def test_bad_options(meta, x, kwargs, message):
    with raises_exactly(ValueError, message):
        mxflash.quantize(x, meta, **kwargs)


def test_bad_scale_shape_names(meta):
    with raises_exactly(ValueError, "orientation: must be hdim, seq or square32"):
        mxflash.scale_shape(meta, 2, "rows")
    with raises_exactly(ValueError, "heads: must be >= 1"):
        mxflash.scale_shape(meta, 0, "hdim")


# ---------------------------------------------------------------------------- quantize: outputs
@pytest.mark.parametrize("out,message", [
    (lambda: (np.zeros((146, H, 128), np.float32), sentinel((146, H, 4))),
     "payload: dtype must be float8_e4m3fn or uint8, got float32"),
    (lambda: (sentinel((146, H, 128)), sentinel((146, H, 5))), "scales: shape must be (146, 2, 4), got (146, 2, 5)"),
    (lambda: (sentinel((146, H, 128)), np.zeros((146, H, 4), np.int32)),
     "scales: dtype must be float8_e8m0fnu or uint8, got int32"),
    (lambda: (sentinel((H, 146, 128)).transpose(1, 0, 2), sentinel((146, H, 4))),
     "payload: must be contiguous (row-major, no gaps)"),
])
def test_bad_outputs_and_nothing_written(meta, x, out, message):
    payload, scales = out()
    with raises_exactly(ValueError, message):
        mxflash.quantize(x, meta, out=(payload, scales))
    assert untouched(*(a for a in (payload, scales) if a.dtype.itemsize == 1))


@pytest.mark.parametrize("kwargs", [dict(mode="ceil"), dict(orientation="rows"), dict(scale_layout="blocked128x4")])
def test_rejected_call_writes_nothing(meta, x, kwargs):
    payload, scales = sentinel((146, H, 128), E4M3), sentinel((146, H, 4))  # plain hdim shapes
    with pytest.raises(ValueError):
        mxflash.quantize(x, meta, out=(payload, scales), **kwargs)
    assert untouched(payload, scales)
    with pytest.raises(ValueError):
        mxflash.quantize(x[:100], meta, out=(payload, scales))
    assert untouched(payload, scales)


def test_quantize_hdim_seq_rejects_and_writes_nothing(meta, x):
    outs = [sentinel((146, H, 128)), sentinel((146, H, 4)), sentinel((146, H, 128)), sentinel((3, H, 128))]
    with raises_exactly(ValueError, "scales_seq: shape must be (12, 2, 128), got (3, 2, 128)"):
        mxflash.quantize_hdim_seq(x, meta, out=outs)
    assert untouched(*outs)
    with raises_exactly(ValueError, "out: must be a tuple (payload_hdim, scales_hdim, payload_seq, scales_seq)"):
        mxflash.quantize_hdim_seq(x, meta, out=outs[:2])


def test_read_only_output_is_refused(meta, x):
    payload, scales = sentinel((146, H, 128)), sentinel((146, H, 4))
    scales.flags.writeable = False
    with raises_exactly(ValueError, "scales: array is read-only"):
        mxflash.quantize(x, meta, out=(payload, scales))
    assert untouched(payload)


# ---------------------------------------------------------------------------- dequantize, converters
def test_dequantize_errors(meta, x):
    p, s = mxflash.quantize(x, meta, "seq")
    out = sentinel((146, H, 128 * 4), np.float32).reshape(146, H, 128)
    with raises_exactly(ValueError, "scales: dtype must be float8_e8m0fnu or uint8, got float32"):
        mxflash.dequantize(p, s.astype(np.float32), meta, "seq", out=out)
    with raises_exactly(ValueError, "scales: shape must be (12, 2, 128), got (146, 2, 4)"):
        mxflash.dequantize(p, np.zeros((146, H, 4), np.uint8), meta, "seq", out=out)
    with raises_exactly(ValueError, "payload: must be contiguous (row-major, no gaps)"):
        mxflash.dequantize(np.ascontiguousarray(p.transpose(1, 0, 2)).transpose(1, 0, 2), s, meta, "seq", out=out)
    with raises_exactly(ValueError, "payload: shape must be (2, 128, 384), got (146, 2, 128)"):
        mxflash.dequantize(p, s, meta, "seq", payload_layout="token_contiguous", out=out)
    assert untouched(out)
    with raises_exactly(ValueError, "out: dtype must be float32 or bfloat16, got float16"):
        mxflash.dequantize(p, s, meta, "seq", out=np.zeros((146, H, 128), np.float16))
    with raises_exactly(ValueError, "out_dtype: must be float32 or bfloat16, got 'float16'"):
        mxflash.dequantize(p, s, meta, "seq", out_dtype="float16")
    with raises_exactly(ValueError, "orientation: must be hdim, seq or square32"):
        mxflash.dequantize(p, s, meta, "sequence")


def test_converter_errors(meta, x):
    p, s = mxflash.quantize(x, meta, "seq")
    dst = sentinel((H, 128, 384))
    with raises_exactly(ValueError, "src: shape must be (146, 2, 128), got (145, 2, 128)"):
        mxflash.to_token_contiguous(p[:145], meta, out=dst)
    with raises_exactly(ValueError, "src: dtype must be float8_e4m3fn or uint8 or float8_e8m0fnu, got bfloat16"):
        mxflash.to_token_contiguous(x, meta, out=dst)
    with raises_exactly(ValueError, "dst: shape must be (146, 2, 128), got (2, 128, 384)"):
        mxflash.to_token_major(dst, meta, out=dst)
    assert untouched(dst)
    blocked = sentinel(mxflash.scale_shape(meta, H, "seq", "blocked128x4"))
    with raises_exactly(ValueError, "plain: shape must be (12, 2, 128), got (12, 2, 4)"):
        mxflash.scales_to_blocked(s[:, :, :4].copy(), meta, "seq", out=blocked)
    with raises_exactly(ValueError, "heads: must be >= 1"):
        mxflash.scales_to_blocked(s, meta, "seq", heads=0, out=blocked)
    with raises_exactly(ValueError, "orientation: must be hdim, seq or square32"):
        mxflash.scales_to_plain(blocked, meta, "cols", heads=2)
    assert untouched(blocked)


def test_non_invalid_status_is_runtime_error(meta, x):
    # In a CPU-only build a CUDA view passes every argument check, then the launcher reports
    # kUnsupported: that must surface as RuntimeError with the message (fake pointers, never used).
    if mxflash.cuda_built():
        pytest.skip("needs a build without CUDA")
    view = lambda shape, code: (4096, code, _mxflash.DEVICE_CUDA, 0, list(shape),
                                [int(np.prod(shape[i + 1:])) for i in range(len(shape))])
    with raises_exactly(RuntimeError, "x: CUDA tensors need a CUDA build"):
        _mxflash.quantize(meta._host, view((146, H, 128), _mxflash.DTYPES["bfloat16"]), 0, 0, 0, 0,
                          view((146, H, 128), _mxflash.DTYPES["uint8"]), view((146, H, 4), _mxflash.DTYPES["uint8"]), 0)


# ---------------------------------------------------------------------------- CUDA


def test_cuda_mixed_devices_rejected(torch_cuda, meta, x):
    torch = torch_cuda
    xg = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
    with raises_exactly(ValueError, "payload: must be on the same device as x (cuda:0), got cpu"):
        mxflash.quantize(xg, meta, out=(sentinel((146, H, 128)), sentinel((146, H, 4))))
    pg = torch.full((146, H, 128), 0xAB, dtype=torch.uint8, device="cuda")
    sg = torch.full((146, H, 4), 0xAB, dtype=torch.uint8, device="cuda")
    with raises_exactly(ValueError, "payload: must be on the same device as x (cpu), got cuda:0"):
        mxflash.quantize(x, meta, out=(pg, sg))
    with raises_exactly(ValueError, "scales: must be on the same device as x (cuda:0), got cpu"):
        mxflash.quantize(xg, meta, out=(pg, sg.cpu()))
    p, s = mxflash.quantize(xg, meta)
    with raises_exactly(ValueError, "scales: must be on the same device as payload (cuda:0), got cpu"):
        mxflash.dequantize(p, s.cpu(), meta, "hdim")
    with raises_exactly(ValueError, "dst: must be on the same device as src (cuda:0), got cpu"):
        mxflash.to_token_contiguous(p, meta, out=np.zeros((H, 128, 384), np.uint8))
    torch.cuda.synchronize()
    assert bool((pg == 0xAB).all()) and bool((sg == 0xAB).all())


def test_cuda_bad_arguments_write_nothing(torch_cuda, meta, x):
    torch = torch_cuda
    xg = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
    pg = torch.full((146, H, 128), 0xAB, dtype=torch.uint8, device="cuda")
    sg = torch.full((146, H, 4), 0xAB, dtype=torch.uint8, device="cuda")
    cases = [
        (dict(x=xg.half()), "x: dtype must be bfloat16 or float32, got float16"),
        (dict(x=xg.transpose(0, 1).contiguous().transpose(0, 1)), "x: must be contiguous (row-major, no gaps)"),
        (dict(x=xg[:100]), "x: token count (axis 0) is 100 but meta holds 146 tokens"),
        (dict(x=xg, mode="ceil"), "mode: must be rceil or floor"),
        (dict(x=xg, orientation="seq"), "scales: shape must be (12, 2, 128), got (146, 2, 4)"),
    ]
    for kwargs, message in cases:
        with raises_exactly(ValueError, message):
            mxflash.quantize(meta=meta, out=(pg, sg), **kwargs)
    torch.cuda.synchronize()
    assert bool((pg == 0xAB).all()) and bool((sg == 0xAB).all())


def test_cuda_failed_runtime_call_leaves_no_error_behind(torch_cuda, meta, x):
    # A failed CUDA runtime call inside the bindings (here cudaSetDevice on a device that does not
    # exist) must not leave its error to be picked up by the next launch's error check.
    torch = torch_cuda
    with pytest.raises(RuntimeError, match="^cudaSetDevice: "):
        mxflash.JaggedMeta.from_lengths(LENGTHS).upload(10_000)
    xg = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
    p, s = mxflash.quantize(xg, meta)
    cp, cs = mxflash.quantize(x, meta)
    assert np.array_equal(s.cpu().numpy(), cs) and np.array_equal(p.view(torch.uint8).cpu().numpy(), cp.view(np.uint8))
