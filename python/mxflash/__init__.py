"""mxflash: MXFP8 (E4M3 elements, E8M0 block scales) quantization and attention for jagged tensors.

Tensors are packed jagged batches: the tokens of all sequences concatenated, shape (T, H, 128),
described by a :class:`JaggedMeta`. Every function accepts

* numpy arrays (runs the C++ CPU reference; returns numpy arrays), with bf16 as
  ``ml_dtypes.bfloat16``, E4M3 payloads as ``ml_dtypes.float8_e4m3fn`` or ``uint8`` and E8M0
  scales as ``ml_dtypes.float8_e8m0fnu`` or ``uint8``;
* torch tensors, on the CPU (CPU reference) or on a CUDA device (CUDA kernels, enqueued on the
  current torch stream of that device, no synchronization); returns torch tensors on the same
  device. Other objects with ``__dlpack__`` are taken through ``torch.from_dlpack`` (CUDA) or
  ``numpy.from_dlpack`` (CPU).

Outputs: payloads are ``float8_e4m3fn`` (numpy: ml_dtypes; torch: ``torch.float8_e4m3fn``), scales
are raw E8M0 bytes as ``uint8`` (value = 2**(byte - 127), 255 = NaN) with both numpy and torch.
Every function takes ``out=`` to write into preallocated tensors instead.

Attention: :func:`attention_forward` takes MX operands (:class:`MxTensor`, e.g. from
:func:`quantize_mx`): Q and K hdim-oriented, V seq-oriented; it returns out (bf16) and lse (fp32).
:func:`quantize_attention_forward` writes the forward's operands in the kernel's execution layout
(:class:`AttentionFwdOperands`) in one pass over Q, K, V, and :func:`attention_forward_operands`
runs the forward on them (no prepare pass: faster on CUDA than the MX-operand forward).
:func:`attention_backward` takes MX operands in both orientations; :func:`quantize_attention_backward`
writes the backward's operands in its execution layout (:class:`AttentionBwdOperands`) from the same
inputs, and :func:`attention_backward_operands` runs the backward on them (no prepare passes).
Every attention function takes ``causal=``: False (the default, every key), True or "top_left"
(query row i of a sequence attends keys j <= i, as torch's
``scaled_dot_product_attention(is_causal=True)``) or "bottom_right" (keys j <= i + Lk - Lq, the
diagonal ending at the last row and key, FlashAttention's causal; rows i < Lq - Lk then attend no
key and give out 0, lse -inf and zero gradients). Lq == Lk gives the same mask either way. Any other
causal= value raises ValueError naming causal (checked here, before the library's checks).

All argument checking is done by the C++ library: a broken rule raises ``ValueError`` whose
message names the argument (nothing is written); other failures (no CUDA in this build, CUDA
errors) raise ``RuntimeError``. Inputs are never copied: non-contiguous tensors are rejected.
"""
from __future__ import annotations

import sys

import numpy as np
import ml_dtypes

from . import _mxflash as _C

__all__ = [
    "gemm_quantize",
    "JaggedMeta",
    "MxTensor",
    "AttentionFwdOperands",
    "attention_forward",
    "attention_forward_operands",
    "AttentionBwdOperands",
    "attention_bwd_operand_shapes",
    "quantize_attention_backward",
    "attention_backward_operands",
    "quantize_attention_forward",
    "quantize_attention_training",
    "attention_fwd_operand_shapes",
    "attention_backward",
    "quantize",
    "quantize_mx",
    "quantize_hdim_seq",
    "rmsnorm_quantize",
    "rmsnorm_backward",
    "dequantize",
    "to_token_contiguous",
    "to_token_major",
    "scales_to_blocked",
    "scales_to_plain",
    "scale_shape",
    "payload_shape",
    "e4m3_encode",
    "e4m3_decode",
    "e8m0_scale",
    "e8m0_decode",
    "cuda_built",
    "BLOCK_SIZE",
    "HEAD_DIM",
    "E4M3_MAX",
]

__version__ = "0.1.0"

BLOCK_SIZE = _C.BLOCK_SIZE  # elements sharing one E8M0 scale
HEAD_DIM = _C.HEAD_DIM  # the only head dimension supported
E4M3_MAX = _C.E4M3_MAX

_NP_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e8m0fnu": np.dtype(ml_dtypes.float8_e8m0fnu),
    "int32": np.dtype(np.int32),
    "uint8": np.dtype(np.uint8),
}
_BYTE_DTYPES = ("float8_e4m3fn", "float8_e8m0fnu", "uint8")
_PAYLOAD_DTYPE = "float8_e4m3fn"
_SCALE_DTYPE = "uint8"


def cuda_built() -> bool:
    """True when the extension was compiled with the CUDA kernels."""
    return bool(_C.WITH_CUDA)


# ---------------------------------------------------------------------------- torch, lazily
_torch_module = None


def _torch():
    """The torch module if importable (imported on first need only), else None."""
    global _torch_module
    if _torch_module is None:
        try:
            import torch
        except ImportError:
            torch = False
        _torch_module = torch
    return _torch_module or None


def _is_torch_tensor(obj) -> bool:
    torch = sys.modules.get("torch")  # an object cannot be a tensor unless torch is imported
    return torch is not None and isinstance(obj, torch.Tensor)


def _as_array(obj, name):
    """numpy arrays and torch tensors pass through; other DLPack objects are wrapped (no copy)."""
    if isinstance(obj, np.ndarray) or _is_torch_tensor(obj):
        return obj
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        dev_type = int(obj.__dlpack_device__()[0])
        if dev_type == 1:  # kDLCPU
            return np.from_dlpack(obj)
        torch = _torch()
        if torch is None:
            raise TypeError(f"{name}: device arrays need torch (to allocate outputs); torch is not importable")
        return torch.from_dlpack(obj)
    raise TypeError(f"{name}: expected a numpy array, a torch tensor or a DLPack array, got {type(obj).__name__}")


_TORCH_DTYPE_CODES = None


def _torch_dtype_codes():
    """torch dtype -> the bindings' dtype code (_C.DTYPES by torch's names), made on first use."""
    global _TORCH_DTYPE_CODES
    if _TORCH_DTYPE_CODES is None:
        torch = _torch()
        _TORCH_DTYPE_CODES = {getattr(torch, n): c for n, c in _C.DTYPES.items()
                              if isinstance(getattr(torch, n, None), torch.dtype)}
    return _TORCH_DTYPE_CODES


def _view(arr, name, writable=False):
    """The raw view tuple the bindings take: (ptr, dtype code, device code, device id, shape, strides)."""
    if isinstance(arr, np.ndarray):
        dtype_name = arr.dtype.name
        code = _C.DTYPES.get(dtype_name) if arr.dtype == _NP_DTYPES.get(dtype_name) else None
        item = arr.dtype.itemsize
        strides = [s // item if s % item == 0 else -1 for s in arr.strides]
        ptr, device, device_id = arr.ctypes.data, _C.DEVICE_CPU, 0
        if writable and not arr.flags.writeable:
            raise ValueError(f"{name}: array is read-only")
    else:
        # (the cheapest torch accessors: a training step converts ~43 tensors, and the host's time
        # per step bounds small attention layers)
        code = _torch_dtype_codes().get(arr.dtype)
        dtype_name = str(arr.dtype).replace("torch.", "") if code is None else None
        strides = list(arr.stride())
        ptr = arr.data_ptr()
        if arr.is_cuda:
            device, device_id = _C.DEVICE_CUDA, arr.get_device()
        elif arr.is_cpu:
            device, device_id = _C.DEVICE_CPU, 0
        else:
            raise ValueError(f"{name}: device {arr.device} is not supported (cpu or cuda)")
    if code is None:
        raise ValueError(
            f"{name}: dtype {dtype_name} is not supported (mxflash takes {', '.join(_C.DTYPES)})")
    if arr.ndim > 4:
        raise ValueError(f"{name}: must have at most 4 dimensions, got {arr.ndim}")
    shape = [int(s) for s in arr.shape] if isinstance(arr, np.ndarray) else list(arr.shape)
    if 0 in shape:
        # No element is addressed, so the strides mean nothing (numpy reports zeros): pass row-major.
        strides = [int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]
    return (ptr, code, device, device_id, shape, strides)


def _is_cuda(arr) -> bool:
    return not isinstance(arr, np.ndarray) and arr.is_cuda


def _empty(like, shape, dtype_name):
    """An uninitialized output next to `like`: numpy for numpy, torch on like's device for torch."""
    shape = tuple(int(s) for s in shape)
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype=_NP_DTYPES[dtype_name])
    torch = _torch()
    return torch.empty(shape, dtype=getattr(torch, dtype_name), device=like.device)


def _stream(like) -> int:
    if _is_cuda(like):
        raw = getattr(_torch()._C, "_cuda_getCurrentRawStream", None)  # (no Stream object made)
        if raw is not None:
            return int(raw(like.get_device()))
        return int(_torch().cuda.current_stream(like.device).cuda_stream)
    return 0


def _code(table, value) -> int:
    """Enum name -> code; unknown names map to -1, which the C++ launchers reject by name."""
    return table.get(value, -1) if isinstance(value, str) else -1


_CAUSAL_NAMES = ("top_left", "bottom_right")


def _causal_code(causal) -> int:
    """The CausalMask code of a ``causal=`` argument: False -> none, True -> top_left, or the names
    "top_left", "bottom_right". Anything else raises ValueError naming causal."""
    if isinstance(causal, (bool, np.bool_)):
        return _C.CAUSAL_MASKS["top_left" if causal else "none"]
    if isinstance(causal, str) and causal in _CAUSAL_NAMES:
        return _C.CAUSAL_MASKS[causal]
    raise ValueError(f'causal: must be False, True, "top_left" or "bottom_right", got {causal!r}')


def _check_meta(meta, name="meta"):
    if not isinstance(meta, JaggedMeta):
        raise TypeError(f"{name}: expected mxflash.JaggedMeta, got {type(meta).__name__}")


def _outputs(out, n, what):
    if out is None:
        return None
    if not isinstance(out, (tuple, list)) or len(out) != n:
        raise ValueError(f"out: must be a tuple ({what})")
    return tuple(out)


# ---------------------------------------------------------------------------- metadata
def _int_list(values, name):
    if _is_torch_tensor(values):
        values = values.detach().cpu().numpy()
    a = np.asarray(values)
    if a.ndim != 1:
        raise ValueError(f"{name}: must be 1-D, got shape {a.shape}")
    if a.size == 0:
        return []
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name}: must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64).tolist()


def _device_index(device) -> int:
    torch = _torch()
    if device is None:
        if torch is None:
            raise RuntimeError("device: torch is not importable; pass a CUDA device index")
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    if torch is not None:
        d = torch.device(device)
        if d.type != "cuda":
            raise ValueError(f"device: must be a CUDA device, got {d}")
        return torch.cuda.current_device() if d.index is None else d.index
    raise ValueError(f"device: expected a CUDA device index, got {device!r}")


class JaggedMeta:
    """Sequences of a packed batch (tokens of all sequences concatenated).

    cu_seqlens (B+1, int32) starts at 0 and is monotone; sequence b is tokens
    [cu_seqlens[b], cu_seqlens[b+1]). cu_seqlens_sf holds the prefix sums of each length rounded up
    to 128: where sequence b's scale rows (and token-contiguous payload) start. Zero-length
    sequences are legal. The device copy a CUDA call needs is made on first use on each device
    (a blocking copy); call upload() beforehand when that matters (e.g. before CUDA-graph capture).
    """

    __slots__ = ("_host", "_dev")

    def __init__(self, *args, **kwargs):
        raise TypeError("use JaggedMeta.from_lengths(...) or JaggedMeta.from_cu_seqlens(...)")

    @classmethod
    def _wrap(cls, cpp):
        self = object.__new__(cls)
        self._host = cpp
        self._dev = {}
        return self

    @classmethod
    def from_lengths(cls, lengths) -> "JaggedMeta":
        """From B >= 1 non-negative sequence lengths (list, numpy array or CPU tensor of ints)."""
        return cls._wrap(_C.JaggedMeta.from_lengths(_int_list(lengths, "lengths")))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, cu_seqlens_sf=None) -> "JaggedMeta":
        """From B+1 cumulative offsets; cu_seqlens_sf, when given, is checked against them."""
        cu = _int_list(cu_seqlens, "cu_seqlens")
        meta = _C.JaggedMeta.from_cu_seqlens(cu)
        if cu_seqlens_sf is not None:
            _C.JaggedMeta.check_cu_seqlens_sf(cu, _int_list(cu_seqlens_sf, "cu_seqlens_sf"))
        return cls._wrap(meta)

    @property
    def cu_seqlens(self) -> np.ndarray:
        return np.asarray(self._host.cu_seqlens, dtype=np.int32)

    @property
    def cu_seqlens_sf(self) -> np.ndarray:
        return np.asarray(self._host.cu_seqlens_sf, dtype=np.int32)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.cu_seqlens)

    @property
    def batch(self) -> int:
        return self._host.batch

    @property
    def total_tokens(self) -> int:
        return self._host.total_tokens

    @property
    def padded_tokens(self) -> int:
        return self._host.padded_tokens

    @property
    def max_seqlen(self) -> int:
        return self._host.max_seqlen

    def upload(self, device=None) -> "JaggedMeta":
        """Makes the device copy on `device` (CUDA index, "cuda:N" or torch.device; default: the
        current torch device) now rather than on first use. Returns self."""
        self._for_device(_device_index(device))
        return self

    def _for_device(self, device_id):
        m = self._dev.get(device_id)
        if m is None:
            m = self._host.uploaded_copy(device_id)
            self._dev[device_id] = m
        return m

    def _cpp_for(self, arr):
        # Without CUDA in the build there is no device copy to make; the launcher then reports
        # that CUDA tensors need a CUDA build (after checking the arguments).
        if _is_cuda(arr) and _C.WITH_CUDA:
            return self._for_device(arr.device.index)
        return self._host

    def __repr__(self):
        return (f"JaggedMeta(batch={self.batch}, total_tokens={self.total_tokens}, "
                f"padded_tokens={self.padded_tokens}, max_seqlen={self.max_seqlen})")


# ---------------------------------------------------------------------------- shapes
def scale_shape(meta, heads, orientation, layout="plain") -> tuple:
    """Shape of the scale tensor for an orientation and scale layout:
    plain: hdim (T, H, 4), seq (P/32, H, 128), square32 (P/32, H, 4);
    blocked128x4: hdim and square32 (H*P/4, 16), seq (H*32, P/8)."""
    _check_meta(meta)
    return tuple(_C.scale_shape(meta._host, int(heads), _code(_C.ORIENTATIONS, orientation),
                                _code(_C.SCALE_LAYOUTS, layout)))


def payload_shape(meta, heads, layout="token_major") -> tuple:
    """(T, H, 128) for token_major, (H, 128, P) for token_contiguous."""
    _check_meta(meta)
    return tuple(_C.payload_shape(meta._host, int(heads), _code(_C.PAYLOAD_LAYOUTS, layout)))


def _heads_of_input(x, meta):
    """Head count of a (T, H, 128) input; 1 when x is malformed (the launcher then rejects x)."""
    if x.ndim == 3 and x.shape[0] == meta.total_tokens and x.shape[1] >= 1 and x.shape[2] == HEAD_DIM:
        return int(x.shape[1])
    return 1


def _kv_heads(hk, heads):
    """K and V's head count hk where it divides heads (grouped-query attention), else heads (the
    launcher then rejects k by name)."""
    return hk if hk >= 1 and heads % hk == 0 else heads


def _kv_heads_of_input(k, k_meta, heads):
    """_kv_heads of a (Tk, Hkv, 128) input."""
    return _kv_heads(_heads_of_input(k, k_meta), heads)


def _shape_or_empty(fn, *args):
    """Output shape, or (0,) when an enum name is unknown (the launcher rejects it first)."""
    try:
        return fn(*args)
    except ValueError:
        return (0,)


# ---------------------------------------------------------------------------- quantization
def quantize(x, meta, orientation="hdim", mode="rceil", scale_layout="plain",
             payload_layout="token_major", out=None):
    """MX-quantizes x (T, H, 128), bf16 or float32, into (payload, scales).

    orientation: "hdim" (blocks of 32 head-dim values of one token), "seq" (32 tokens of one
    sequence, one column; blocks start at each sequence start) or "square32" (32 tokens x 32 dims).
    mode: "rceil" (scale 2^ceil(log2(amax/448))) or "floor" (2^(floor(log2 amax) - 8)).
    scale_layout: "plain" or "blocked128x4" (see scale_shape). payload_layout: "token_major"
    (T, H, 128) or "token_contiguous" (H, 128, P), the latter for seq and square32 only.
    Returns (payload float8_e4m3fn, scales uint8); out=(payload, scales) writes into given tensors.
    """
    _check_meta(meta)
    x = _as_array(x, "x")
    outs = _outputs(out, 2, "payload, scales")
    if outs is None:
        heads = _heads_of_input(x, meta)
        payload = _empty(x, _shape_or_empty(payload_shape, meta, heads, payload_layout), _PAYLOAD_DTYPE)
        scales = _empty(x, _shape_or_empty(scale_shape, meta, heads, orientation, scale_layout), _SCALE_DTYPE)
    else:
        payload, scales = (_as_array(o, n) for o, n in zip(outs, ("payload", "scales")))
    _C.quantize(meta._cpp_for(x), _view(x, "x"), _code(_C.ORIENTATIONS, orientation), _code(_C.MODES, mode),
                _code(_C.SCALE_LAYOUTS, scale_layout), _code(_C.PAYLOAD_LAYOUTS, payload_layout),
                _view(payload, "payload", True), _view(scales, "scales", True), _stream(x))
    return payload, scales


class MxTensor:
    """An MX operand: E4M3 payload + E8M0 scales and how they are laid out (no copy, no checks:
    the functions that take one check it). orientation: "hdim", "seq" or "square32";
    scale_layout: "plain" or "blocked128x4"; payload_layout: "token_major" (T, H, 128) or
    "token_contiguous" (H, 128, P). Build one with :func:`quantize_mx` or from existing tensors."""

    __slots__ = ("payload", "scales", "orientation", "scale_layout", "payload_layout")

    def __init__(self, payload, scales, orientation, scale_layout="plain", payload_layout="token_major"):
        self.payload = payload
        self.scales = scales
        self.orientation = orientation
        self.scale_layout = scale_layout
        self.payload_layout = payload_layout

    def dequantize(self, meta, out_dtype="float32", out=None):
        """:func:`dequantize` of this operand: (T, H, 128) float32 or bfloat16."""
        return dequantize(self.payload, self.scales, meta, self.orientation, self.scale_layout,
                          self.payload_layout, out_dtype=out_dtype, out=out)

    def __repr__(self):
        def desc(a):
            return f"{type(a).__name__}{tuple(int(d) for d in a.shape)} {a.dtype}" if hasattr(a, "shape") else repr(a)
        return (f"MxTensor(payload={desc(self.payload)}, scales={desc(self.scales)}, "
                f"orientation={self.orientation!r}, scale_layout={self.scale_layout!r}, "
                f"payload_layout={self.payload_layout!r})")


def quantize_mx(x, meta, orientation, mode="rceil", scale_layout="plain", payload_layout="token_major",
                out=None) -> MxTensor:
    """:func:`quantize`, returned as an :class:`MxTensor` that records the orientation and layouts
    (what :func:`attention_forward` takes: Q and K with "hdim", V with "seq")."""
    payload, scales = quantize(x, meta, orientation, mode, scale_layout, payload_layout, out=out)
    return MxTensor(payload, scales, orientation, scale_layout, payload_layout)


def quantize_hdim_seq(x, meta, mode="rceil", scale_layout="plain", payload_layout="token_major", out=None):
    """hdim and seq quantization of x from one read.

    Returns (payload_hdim, scales_hdim, payload_seq, scales_seq). payload_layout applies to the seq
    payload (the hdim payload is always token_major); scale_layout to both scale tensors.
    """
    _check_meta(meta)
    x = _as_array(x, "x")
    names = ("payload_hdim", "scales_hdim", "payload_seq", "scales_seq")
    outs = _outputs(out, 4, ", ".join(names))
    if outs is None:
        heads = _heads_of_input(x, meta)
        outs = (
            _empty(x, payload_shape(meta, heads, "token_major"), _PAYLOAD_DTYPE),
            _empty(x, _shape_or_empty(scale_shape, meta, heads, "hdim", scale_layout), _SCALE_DTYPE),
            _empty(x, _shape_or_empty(payload_shape, meta, heads, payload_layout), _PAYLOAD_DTYPE),
            _empty(x, _shape_or_empty(scale_shape, meta, heads, "seq", scale_layout), _SCALE_DTYPE),
        )
    else:
        outs = tuple(_as_array(o, n) for o, n in zip(outs, names))
    _C.quantize_hdim_seq(meta._cpp_for(x), _view(x, "x"), _code(_C.MODES, mode),
                         _code(_C.SCALE_LAYOUTS, scale_layout), _code(_C.PAYLOAD_LAYOUTS, payload_layout),
                         *(_view(o, n, True) for o, n in zip(outs, names)), _stream(x))
    return outs


def _rows_cols(x):
    """(T, C) of the RMSNorm functions' x, which must be 2-D."""
    if x.ndim != 2:
        raise ValueError(f"x: must be 2-D (T, C), got shape {tuple(int(d) for d in x.shape)}")
    return int(x.shape[0]), int(x.shape[1])


def rmsnorm_quantize(x, weight=None, eps=1e-6, mode="rceil", rstd=True, out=None):
    """RMSNorm and MX quantization along each row, in one pass over x (a fused producer).

    x: (T, C) bfloat16 or float32, C a multiple of 32 from 32 to 65536. weight: (C) float32 or
    bfloat16, or None. In fp32 (y is never rounded to bf16):
    rstd[t] = 1 / sqrt(mean(x[t] ** 2) + eps) and y[t] = x[t] * rstd[t] * weight, quantized in blocks
    of 32 along C (mode "rceil" or "floor"): the operand of a GEMM that contracts over C. For
    C = H * 128 the bytes equal ``quantize(y.reshape(T, H, 128), meta, "hdim")``. A NaN y is stored
    as 0x7F; a block holding inf or NaN gets scale 255.
    Returns (payload (T, C) float8_e4m3fn, scales (T, C // 32) uint8, rstd (T,) float32, or None
    when rstd=False: what an RMSNorm backward needs). out=(payload, scales, rstd or None) writes
    into given tensors.
    """
    x = _as_array(x, "x")
    if weight is not None:
        weight = _as_array(weight, "weight")
    outs = _outputs(out, 3, "payload, scales, rstd")
    if outs is None:
        rows, cols = _rows_cols(x)
        payload = _empty(x, (rows, cols), _PAYLOAD_DTYPE)
        scales = _empty(x, (rows, cols // BLOCK_SIZE), _SCALE_DTYPE)
        r = _empty(x, (rows,), "float32") if rstd else None
    else:
        payload, scales = (_as_array(o, n) for o, n in zip(outs[:2], ("payload", "scales")))
        r = None if outs[2] is None else _as_array(outs[2], "rstd")
    _C.rmsnorm_quantize(_view(x, "x"), None if weight is None else _view(weight, "weight"), float(eps),
                        _code(_C.MODES, mode), _view(payload, "payload", True), _view(scales, "scales", True),
                        None if r is None else _view(r, "rstd", True), _stream(x))
    return payload, scales, r


def rmsnorm_backward(x, weight, rstd, dy, out=None):
    """The backward of rmsnorm_quantize's RMSNorm (y = x * rstd * weight), one fused pass for dx:

        xh = x * rstd,  dx = (dy * weight - xh * mean(dy * weight * xh)) * rstd,
        dweight = sum over rows of dy * xh   (deterministic: fixed-order sums, no atomics).

    x: (T, C) bfloat16 or float32 (the forward's input); weight: (C) float32 / bfloat16 or None;
    rstd: (T) float32 (rmsnorm_quantize's); dy: (T, C) in x's dtype, the gradient of y (straight
    through the quantization). Returns (dx (T, C) x's dtype, dweight (C) float32, or None without a
    weight). out=(dx, dweight or None) writes into given tensors.
    """
    x, rstd, dy = (_as_array(t, n) for t, n in ((x, "x"), (rstd, "rstd"), (dy, "dy")))
    if weight is not None:
        weight = _as_array(weight, "weight")
    outs = _outputs(out, 2, "dx, dweight")
    if outs is None:
        rows, cols = _rows_cols(x)
        dx = _empty(x, (rows, cols), _dtype_name(x))
        dw = _empty(x, (cols,), "float32") if weight is not None else None
    else:
        dx = _as_array(outs[0], "dx")
        dw = None if outs[1] is None else _as_array(outs[1], "dweight")
    _C.rmsnorm_backward(_view(x, "x"), None if weight is None else _view(weight, "weight"), _view(rstd, "rstd"),
                        _view(dy, "dy"), _view(dx, "dx", True), None if dw is None else _view(dw, "dweight", True),
                        _stream(x))
    return dx, dw


def gemm_quantize(a, a_scales, w, w_scales, mode="rceil", path="auto", out=None):
    """y = a @ w.T with MX operands, quantized to MX along its rows, in one pass (a fused producer:
    the projections that write Q, K, V for attention_forward).

    a: (M, K) float8_e4m3fn (or uint8) with a_scales (M, K // 32) uint8 E8M0, blocks along K (what
    rmsnorm_quantize returns); w: (N, K) the same (nn.Linear's weight layout, quantized along K). K
    and N multiples of 32. y is quantized in blocks of 32 along N (mode "rceil" or "floor"): for
    N = H * 128 that is the "hdim" operand attention_forward reads.
    path: "auto" (CUDA: the FP8 wgmma kernel where N is a multiple of 128, M >= 128, K >= 128 and the
    pointers are 16-byte aligned, else the exact kernel; CPU: exact), "exact" (every 32-block's scale
    pair applied to its exact partial sum: the MX definition) or "coarse" (the fast kernel's
    arithmetic: A re-expressed against one scale per row, W against one per output channel;
    docs/fused.md gives its accuracy cost). A NaN y is stored as 0x7F.
    Returns (payload (M, N) float8_e4m3fn, scales (M, N // 32) uint8). out=(payload, scales) writes
    into given tensors.
    """
    a, a_scales, w, w_scales = (_as_array(t, n) for t, n in
                                ((a, "a"), (a_scales, "a_scales"), (w, "w"), (w_scales, "w_scales")))
    outs = _outputs(out, 2, "payload, scales")
    if outs is None:
        if a.ndim != 2 or w.ndim != 2:
            raise ValueError(f"a, w: must be 2-D, got shapes {tuple(int(d) for d in a.shape)} and "
                             f"{tuple(int(d) for d in w.shape)}")
        rows, cols = int(a.shape[0]), int(w.shape[0])
        payload = _empty(a, (rows, cols), _PAYLOAD_DTYPE)
        scales = _empty(a, (rows, cols // BLOCK_SIZE), _SCALE_DTYPE)
    else:
        payload, scales = (_as_array(o, n) for o, n in zip(outs, ("payload", "scales")))
    _C.gemm_quantize(_view(a, "a"), _view(a_scales, "a_scales"), _view(w, "w"), _view(w_scales, "w_scales"),
                     _code(_C.MODES, mode), _code(_C.GEMM_PATHS, path), _view(payload, "payload", True),
                     _view(scales, "scales", True), _stream(a))
    return payload, scales


_OUT_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


def _out_dtype_name(out_dtype):
    if isinstance(out_dtype, str):
        name = out_dtype.replace("torch.", "")
    elif _is_torch_tensor_dtype(out_dtype):
        name = str(out_dtype).replace("torch.", "")
    else:
        try:
            name = np.dtype(out_dtype).name
        except TypeError:
            name = None
    if name not in _OUT_DTYPES:
        raise ValueError(f"out_dtype: must be float32 or bfloat16, got {out_dtype!r}")
    return name


def _is_torch_tensor_dtype(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.dtype)


def dequantize(payload, scales, meta, orientation, scale_layout="plain", payload_layout="token_major",
               out_dtype="float32", out=None):
    """Inverse of quantize: out (T, H, 128) = e4m3(payload) * 2^(scale byte - 127), in float32 or
    bfloat16 (out_dtype: name, numpy or torch dtype). out= writes into a given tensor."""
    _check_meta(meta)
    payload = _as_array(payload, "payload")
    scales = _as_array(scales, "scales")
    if out is None:
        pl = _code(_C.PAYLOAD_LAYOUTS, payload_layout)
        heads = 1
        if payload.ndim == 3:
            heads = int(payload.shape[0] if pl == 1 else payload.shape[1]) or 1
        out = _empty(payload, (meta.total_tokens, heads, HEAD_DIM), _out_dtype_name(out_dtype))
    else:
        out = _as_array(out, "out")
    _C.dequantize(meta._cpp_for(payload), _view(payload, "payload"), _view(scales, "scales"),
                  _code(_C.ORIENTATIONS, orientation), _code(_C.SCALE_LAYOUTS, scale_layout),
                  _code(_C.PAYLOAD_LAYOUTS, payload_layout), _view(out, "out", True), _stream(payload))
    return out


# ---------------------------------------------------------------------------- layout converters
def _dtype_name(arr):
    """The dtype of a numpy array or torch tensor by name ("bfloat16", "float32", ...)."""
    return arr.dtype.name if isinstance(arr, np.ndarray) else str(arr.dtype).replace("torch.", "")


def _byte_dtype_of(arr):
    name = _dtype_name(arr)
    return name if name in _BYTE_DTYPES else "uint8"


def _relayout_payload(kernel, payload, meta, out, head_axis, layout):
    """Runs a payload relayout kernel; without out, allocates the (layout) payload with the head
    count read off the source's head_axis."""
    _check_meta(meta)
    src = _as_array(payload, "src")
    if out is None:
        heads = int(src.shape[head_axis]) if src.ndim == 3 and src.shape[head_axis] >= 1 else 1
        out = _empty(src, payload_shape(meta, heads, layout), _byte_dtype_of(src))
    else:
        out = _as_array(out, "dst")
    kernel(meta._cpp_for(src), _view(src, "src"), _view(out, "dst", True), _stream(src))
    return out


def to_token_contiguous(payload, meta, out=None):
    """(T, H, 128) token-major payload -> (H, 128, P) token-contiguous (each sequence starting at
    cu_seqlens_sf[b], padding tokens zero). Any 1-byte dtype; the output keeps the input's."""
    return _relayout_payload(_C.to_token_contiguous, payload, meta, out, 1, "token_contiguous")


def to_token_major(payload, meta, out=None):
    """(H, 128, P) token-contiguous payload -> (T, H, 128) token-major."""
    return _relayout_payload(_C.to_token_major, payload, meta, out, 0, "token_major")


def _heads_of_blocked(blocked, meta, orientation):
    """Head count implied by a blocked scale tensor's shape, or None when it cannot be read off."""
    if blocked.ndim != 2:
        return None
    rows, P = int(blocked.shape[0]), meta.padded_tokens
    if orientation == "seq":
        return rows // 32 if rows % 32 == 0 and rows else None
    if P and (rows * 4) % P == 0 and rows:
        return rows * 4 // P
    return None


def scales_to_blocked(scales, meta, orientation, heads=None, out=None):
    """Plain scales -> blocked128x4 (REFERENCE.md §3), padding bytes zero. heads defaults to the
    plain tensor's axis 1."""
    _check_meta(meta)
    plain = _as_array(scales, "plain")
    if heads is None:
        if plain.ndim != 3:
            raise ValueError(f"heads: cannot be read off plain scales of shape {tuple(plain.shape)}; pass heads=")
        heads = int(plain.shape[1])
    heads = int(heads)
    if out is None:
        shape = _shape_or_empty(scale_shape, meta, max(heads, 1), orientation, "blocked128x4")
        out = _empty(plain, shape, _byte_dtype_of(plain))
    else:
        out = _as_array(out, "blocked")
    _C.scales_to_blocked(meta._cpp_for(plain), _view(plain, "plain"), heads, _code(_C.ORIENTATIONS, orientation),
                         _view(out, "blocked", True), _stream(plain))
    return out


def scales_to_plain(scales, meta, orientation, heads=None, out=None):
    """blocked128x4 scales -> plain. heads defaults to what the blocked shape implies."""
    _check_meta(meta)
    blocked = _as_array(scales, "blocked")
    if heads is None:
        heads = _heads_of_blocked(blocked, meta, orientation)
        if heads is None:
            raise ValueError(f"heads: cannot be read off blocked scales of shape {tuple(blocked.shape)}; pass heads=")
    heads = int(heads)
    if out is None:
        shape = _shape_or_empty(scale_shape, meta, max(heads, 1), orientation, "plain")
        out = _empty(blocked, shape, _byte_dtype_of(blocked))
    else:
        out = _as_array(out, "plain")
    _C.scales_to_plain(meta._cpp_for(blocked), _view(blocked, "blocked"), heads,
                       _code(_C.ORIENTATIONS, orientation), _view(out, "plain", True), _stream(blocked))
    return out


# ---------------------------------------------------------------------------- attention
def _mx_arrays(t, name):
    """(payload, scales) of an MxTensor argument as arrays (DLPack objects wrapped, no copy)."""
    if not isinstance(t, MxTensor):
        raise TypeError(f"{name}: expected mxflash.MxTensor (see mxflash.quantize_mx), got {type(t).__name__}")
    return _as_array(t.payload, f"{name}.payload"), _as_array(t.scales, f"{name}.scales")


def _mx_view(t, arrays, name):
    payload, scales = arrays
    return (_view(payload, f"{name}.payload"), _view(scales, f"{name}.scales"),
            _code(_C.ORIENTATIONS, t.orientation), _code(_C.SCALE_LAYOUTS, t.scale_layout),
            _code(_C.PAYLOAD_LAYOUTS, t.payload_layout))


def _torch_workspace(nbytes, device):
    """(tensor, pointer, bytes) of an attention call's device workspace, from torch's caching
    allocator on the current stream of `device`: the call itself then allocates nothing, and torch
    accounts for the memory. Drop the tensor after the call (stream-ordered behind the kernels)."""
    workspace = _torch().empty(max(int(nbytes), 1), dtype=_torch().uint8, device=device)
    return workspace, workspace.data_ptr(), int(workspace.numel())


def _forward_outputs(ref, heads, q_meta, k_meta, broadcast_q, out, operands=False, causal=0):
    """A forward's (out, lse) (given through out=, or allocated like `ref`) and, for CUDA, its
    workspace from torch's allocator (operands: the execution-layout form's, its work list and the
    split tail's partial states; causal: the mask's code):
    (out, lse, workspace, ptr, bytes)."""
    outs = _outputs(out, 2, "out, lse")
    if outs is None:
        tokens = q_meta.total_tokens * (k_meta.batch if broadcast_q else 1)
        o = _empty(ref, (tokens, heads, HEAD_DIM), "bfloat16")
        lse = _empty(ref, (heads, tokens), "float32")
    else:
        o, lse = _as_array(outs[0], "out"), _as_array(outs[1], "lse")
    workspace = ws_ptr = ws_bytes = 0
    if _is_cuda(ref):
        if operands:
            n = _C.attention_forward_operands_workspace_size(q_meta._host, k_meta._host, heads, broadcast_q, causal)
        else:
            n = _C.attention_forward_workspace_size(q_meta._host, k_meta._host, heads, broadcast_q, causal)
        workspace, ws_ptr, ws_bytes = _torch_workspace(n, ref.device)
    return o, lse, workspace, ws_ptr, ws_bytes


def attention_forward(q, k, v, q_meta, k_meta, softmax_scale=None, broadcast_q=False, out=None, causal=False):
    """MXFP8 attention forward on packed jagged sequences, head dim 128, with or without a causal
    mask.

    q, k, v: :class:`MxTensor` operands (see :func:`quantize_mx`): q and k "hdim"-oriented (token
    major), v "seq"-oriented (token_major or token_contiguous); scales plain or blocked128x4. q is
    described by q_meta, k and v by k_meta; Q sequence b attends to K/V sequence b.
    softmax_scale: None for 1/sqrt(128). broadcast_q: q_meta holds one Q sequence (length Lq) that
    attends to each of the B K/V sequences; output token b*Lq + i.
    causal: False (default: every key), True or "top_left" (row i of a Q sequence of Lq rows attends
    keys j <= i of its K/V sequence of Lk keys: torch's is_causal=True) or "bottom_right" (keys
    j <= i + Lk - Lq: FlashAttention's causal); rows count from each Q sequence's start (with
    broadcast_q, the shared sequence's rows against each K/V sequence). Anything else: ValueError.
    Returns (out, lse): out (To, H, 128) bfloat16, lse (H, To) float32 natural log, To = Tq, or
    B*Lq with broadcast_q; rows with no keys (an empty K/V sequence, or rows i < Lq - Lk under
    "bottom_right") give out = 0 and lse = -inf. out=(out, lse) writes into given tensors. numpy
    operands run the exact-MX CPU reference; CUDA torch tensors run the sm_90a kernel on the current
    stream (workspace from torch's allocator, no synchronization).
    """
    _check_meta(q_meta, "q_meta")
    _check_meta(k_meta, "k_meta")
    causal = _causal_code(causal)
    arrays = [_mx_arrays(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"))]
    qp = arrays[0][0]
    broadcast_q = bool(broadcast_q)
    # Head count as the launcher reads it off q's payload; 1 when malformed (then q is rejected).
    heads = 1
    if qp.ndim == 3:
        heads = int(qp.shape[0] if q.payload_layout == "token_contiguous" else qp.shape[1]) or 1
    o, lse, workspace, ws_ptr, ws_bytes = _forward_outputs(qp, heads, q_meta, k_meta, broadcast_q, out,
                                                           causal=causal)
    scale = float("nan") if softmax_scale is None else float(softmax_scale)
    _C.attention_forward(q_meta._cpp_for(qp), k_meta._cpp_for(qp),
                         *(_mx_view(t, a, n) for t, a, n in zip((q, k, v), arrays, ("q", "k", "v"))),
                         scale, broadcast_q, _view(o, "out", True), _view(lse, "lse", True), ws_ptr, ws_bytes,
                         _stream(qp), causal)
    del workspace  # freed to torch's caching allocator, stream-ordered behind the kernels
    return o, lse


# ---------------------------------------------------------------------------- forward operands
_OPERAND_NAMES = ("q", "q_scale", "k", "k_scale", "v", "v_scale")


class _Operands:
    """What the execution-layout operand sets share: iteration and repr in their __slots__ order, and
    the quantizer that writes them (named in type errors)."""

    __slots__ = ()
    _quantizer = ""

    def __iter__(self):
        return iter(tuple(getattr(self, n) for n in self.__slots__))

    def __repr__(self):
        def desc(a):
            return f"{type(a).__name__}{tuple(int(d) for d in a.shape)} {a.dtype}" if hasattr(a, "shape") else repr(a)
        return type(self).__name__ + "(" + ", ".join(f"{n}={desc(getattr(self, n))}" for n in self.__slots__) + ")"


class AttentionFwdOperands(_Operands):
    """The attention forward's operands in the kernel's execution layout, as
    :func:`quantize_attention_forward` writes them and :func:`attention_forward_operands` reads them
    (no copy, no checks: the functions that take one check it). Pq, Pk: the metadata's padded token
    counts (JaggedMeta.padded_tokens); see :func:`attention_fwd_operand_shapes`.

    q (H, Pq, 128) E4M3 (float8_e4m3fn or uint8), q_scale (H, Pq) float32: one scale per token;
    k (Hkv, Pk, 128) E4M3, k_scale (Hkv, Pk/128) float32: one per 128-key tile;
    v (Hkv, 128, Pk) E4M3 (token-contiguous, tokens of each 32-group in the kernel's fragment
    order), v_scale (Hkv, Pk/128) float32: one per 128-key tile.
    Hkv = H, or a divisor of H for grouped-query attention (Q head h attends K/V head h // (H/Hkv)).
    Padding tokens hold zero bytes (and q_scale 1). Iterating yields the six arrays in that order."""

    __slots__ = _OPERAND_NAMES
    _quantizer = "quantize_attention_forward"

    def __init__(self, q, q_scale, k, k_scale, v, v_scale):
        self.q, self.q_scale = q, q_scale
        self.k, self.k_scale = k, k_scale
        self.v, self.v_scale = v, v_scale


def attention_fwd_operand_shapes(q_meta, k_meta, heads, kv_heads=None) -> dict:
    """Shapes of the :class:`AttentionFwdOperands` for q_meta, k_meta, a head count H and K/V's
    Hkv (kv_heads; None: H; else a divisor of H, grouped-query attention), as a dict
    {"q": (H, Pq, 128), "q_scale": (H, Pq), "k": (Hkv, Pk, 128), "k_scale": (Hkv, Pk/128),
    "v": (Hkv, 128, Pk), "v_scale": (Hkv, Pk/128)}."""
    _check_meta(q_meta, "q_meta")
    _check_meta(k_meta, "k_meta")
    shapes = _C.attention_fwd_operand_shapes(q_meta._host, k_meta._host, int(heads), int(kv_heads or 0))
    return {n: tuple(s) for n, s in zip(_OPERAND_NAMES, shapes)}


def _operand_arrays(ops, name, kind=AttentionFwdOperands, set_name="ops"):
    """The arrays of an operand-set argument of class `kind` (DLPack objects wrapped, no copy), named
    set_name.q ... in messages."""
    if not isinstance(ops, kind):
        raise TypeError(f"{name}: expected mxflash.{kind.__name__} (see mxflash.{kind._quantizer}), "
                        f"got {type(ops).__name__}")
    return tuple(_as_array(getattr(ops, n), f"{set_name}.{n}") for n in kind.__slots__)


def _operand_views(arrays, writable=False, kind=AttentionFwdOperands, set_name="ops"):
    return tuple(_view(a, f"{set_name}.{n}", writable) for a, n in zip(arrays, kind.__slots__))


def quantize_attention_forward(q, k, v, q_meta, k_meta, out=None) -> AttentionFwdOperands:
    """Quantizes q (Tq, H, 128), k and v (Tk, Hkv, 128) (Hkv = H, or a divisor of H: grouped-query
    attention), all bfloat16 or all float32, contiguous, into the forward's operands in the
    execution layout (:class:`AttentionFwdOperands`), in one pass.

    The values are the MX quantizer's (RCEIL, 32-blocks; Q and K along the head dim, V along
    tokens) re-expressed to coarser power-of-two scales, so :func:`attention_forward_operands` on them
    gives what :func:`attention_forward` gives on the :func:`quantize_mx` operands (bit for bit on
    the CPU, unless a value falls below e4m3's subnormal floor of its group). bf16 inputs and their
    float32 conversions give identical bytes. q_meta describes q; k_meta k and v (with one Q
    sequence and B K/V sequences for broadcast_q). Payloads come back float8_e4m3fn, scales float32;
    numpy inputs run the CPU reference, CUDA torch tensors three kernels on the current stream.
    out= an AttentionFwdOperands to write into (every byte, padding included; its arrays are
    named ops.q ... ops.v_scale in error messages). For the backward, quantize MX tensors as before.
    """
    _check_meta(q_meta, "q_meta")
    _check_meta(k_meta, "k_meta")
    q, k, v = _as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v")
    if out is None:
        heads = _heads_of_input(q, q_meta)
        shapes = attention_fwd_operand_shapes(q_meta, k_meta, heads, _kv_heads_of_input(k, k_meta, heads))
        arrays = tuple(_empty(q, shapes[n], _PAYLOAD_DTYPE if n in ("q", "k", "v") else "float32")
                       for n in _OPERAND_NAMES)
        out = AttentionFwdOperands(*arrays)
    else:
        arrays = _operand_arrays(out, "out")
    _C.quantize_attention_forward(q_meta._cpp_for(q), k_meta._cpp_for(q), _view(q, "q"), _view(k, "k"),
                                  _view(v, "v"), _operand_views(arrays, True), _stream(q))
    return out


def attention_forward_operands(ops, q_meta, k_meta, softmax_scale=None, broadcast_q=False, out=None, causal=False):
    """:func:`attention_forward` on execution-layout operands (from :func:`quantize_attention_forward`
    with the same q_meta and k_meta): same outputs, options (causal included) and behaviour. The
    operands do not depend on the mask: one set serves any causal=. Returns (out (To, H, 128)
    bfloat16, lse (H, To) float32); out=(out, lse) writes into given tensors. numpy operands run the
    CPU reference (exact attention of the dequantized operands' values); CUDA torch tensors the sm_90a
    kernel without its prepare pass, on the current stream (workspace from torch's allocator, no
    synchronization).
    """
    _check_meta(q_meta, "q_meta")
    _check_meta(k_meta, "k_meta")
    causal = _causal_code(causal)
    arrays = _operand_arrays(ops, "ops")
    qp = arrays[0]
    broadcast_q = bool(broadcast_q)
    # Head count as the launcher reads it off ops.q; 1 when malformed (then ops.q is rejected).
    heads = (int(qp.shape[0]) or 1) if qp.ndim == 3 else 1
    o, lse, workspace, ws_ptr, ws_bytes = _forward_outputs(qp, heads, q_meta, k_meta, broadcast_q, out, operands=True,
                                                           causal=causal)
    scale = float("nan") if softmax_scale is None else float(softmax_scale)
    _C.attention_forward_operands(q_meta._cpp_for(qp), k_meta._cpp_for(qp), _operand_views(arrays), scale,
                                  broadcast_q, _view(o, "out", True), _view(lse, "lse", True), ws_ptr, ws_bytes,
                                  _stream(qp), causal)
    del workspace  # freed to torch's caching allocator, stream-ordered behind the kernels
    return o, lse


_DQ_ACCUM = {"fp32": 0, "fp16": 1}
_P_SCALE = {"constant": 0, "dynamic": 1}


def attention_backward(q, q_seq, k, k_seq, v, out, dout, lse, q_meta, k_meta, softmax_scale=None,
                       broadcast_q=False, dq_accum="fp32", dq_fp16_scale_log2=12, p_scale="constant",
                       output_mxfp8_dkv=False, exact_mx=False, grads=None, causal=False):
    """MXFP8 attention backward on packed jagged sequences, head dim 128, with or without a causal
    mask.

    q, k: :class:`MxTensor` along the head dim (as for :func:`attention_forward`); q_seq, k_seq: the
    same tensors quantized along tokens ("seq"); v along the head dim. out (To, H, 128) bfloat16 and
    lse (H, To) float32 as the forward returned them, dout (To, H, 128) bfloat16. softmax_scale,
    broadcast_q and causal (False, True / "top_left" or "bottom_right", as for the forward) must
    match the forward's; rows that attend no key get dq = 0 and keys no row attends dk = dv = 0.
    Returns (dq, dk, dv), bfloat16: dq (Tq, H, 128), dk and dv
    (Tk, H, 128); with broadcast_q, dq is summed over the batch. With output_mxfp8_dkv=True, dk and dv
    are float8_e4m3fn payloads quantized in 32x32 blocks and two more arrays come back, dk_scales and
    dv_scales (Tk, H, 4) uint8 E8M0, each token row's block scale. grads=(dq, dk, dv[, dk_scales,
    dv_scales]) writes into given arrays. dq_accum="fp16" (accumulator scaled by
    2**dq_fp16_scale_log2) and p_scale="dynamic" (per-block P scales for dV) are modelled by the CPU
    reference only: the CUDA paths raise RuntimeError for them rather than ignoring them.
    numpy operands run the exact-MX CPU reference; CUDA tensors run the fast sm_90a kernel on the
    current stream (deterministic, no atomics; output_mxfp8_dkv supported; workspace from torch's
    allocator, no synchronization), or with exact_mx=True the exact-MX GPU path (slow; the oracle;
    default options only).
    """
    _check_meta(q_meta, "q_meta")
    _check_meta(k_meta, "k_meta")
    causal = _causal_code(causal)
    names = ("q", "q_seq", "k", "k_seq", "v")
    operands = (q, q_seq, k, k_seq, v)
    arrays = [_mx_arrays(t, n) for t, n in zip(operands, names)]
    qp = arrays[0][0]
    heads = 1
    if qp.ndim == 3:
        heads = int(qp.shape[0] if q.payload_layout == "token_contiguous" else qp.shape[1]) or 1
    o, g, l = _as_array(out, "out"), _as_array(dout, "dout"), _as_array(lse, "lse")
    mx_out = bool(output_mxfp8_dkv)
    outs, scale_views = _backward_outputs(qp, heads, q_meta, k_meta, grads, mx_out)
    dq, dk, dv = outs[:3]
    workspace = ws_ptr = ws_bytes = 0
    if _is_cuda(qp) and not exact_mx:
        n = _C.attention_backward_workspace_size(q_meta._host, k_meta._host, heads, bool(broadcast_q), mx_out, causal)
        workspace, ws_ptr, ws_bytes = _torch_workspace(n, qp.device)
    scale = float("nan") if softmax_scale is None else float(softmax_scale)
    _C.attention_backward(q_meta._cpp_for(qp), k_meta._cpp_for(qp),
                          *(_mx_view(t, a, n) for t, a, n in zip(operands, arrays, names)),
                          _view(o, "out"), _view(g, "dout"), _view(l, "lse"), scale, bool(broadcast_q),
                          _code(_DQ_ACCUM, dq_accum), int(dq_fp16_scale_log2), _code(_P_SCALE, p_scale),
                          bool(output_mxfp8_dkv), bool(exact_mx), _view(dq, "dq", True), _view(dk, "dk", True),
                          _view(dv, "dv", True), *scale_views, ws_ptr, ws_bytes, _stream(qp), causal)
    del workspace  # freed to torch's caching allocator, stream-ordered behind the kernels
    return tuple(outs)


def _backward_outputs(ref, heads, q_meta, k_meta, grads, mx_out, kv_heads=None):
    """The backward's output arrays (given as grads, or new ones next to ref; dk, dv with kv_heads
    heads, None: heads) and the views of the MXFP8 dK, dV scales (None without output_mxfp8_dkv)."""
    kv_heads = kv_heads or heads
    names_out = ("dq", "dk", "dv") + (("dk_scales", "dv_scales") if mx_out else ())
    outs = _outputs(grads, len(names_out), ", ".join(names_out))
    if outs is None:
        tq, tk = q_meta.total_tokens, k_meta.total_tokens
        dkv_dtype = "float8_e4m3fn" if mx_out else "bfloat16"
        outs = [_empty(ref, (tq, heads, HEAD_DIM), "bfloat16"), _empty(ref, (tk, kv_heads, HEAD_DIM), dkv_dtype),
                _empty(ref, (tk, kv_heads, HEAD_DIM), dkv_dtype)]
        if mx_out:
            outs += [_empty(ref, (tk, kv_heads, HEAD_DIM // BLOCK_SIZE), "uint8") for _ in range(2)]
    outs = [_as_array(x, n) for x, n in zip(outs, names_out)]
    scale_views = [_view(x, n, True) for x, n in zip(outs[3:], names_out[3:])] + [None] * (5 - len(outs))
    return outs, scale_views


# ---------------------------------------------------------------------------- backward operands
_BWD_OPERAND_NAMES = ("q", "q_scale", "k", "k_scale", "v", "v_scale", "qt", "qt_scale", "kt", "kt_scale")


class AttentionBwdOperands(_Operands):
    """The attention backward's operands in the kernels' execution layout, as
    :func:`quantize_attention_backward` writes them and :func:`attention_backward_operands` reads
    them (no copy, no checks: the functions that take one check it). Pq, Pk: the metadata's padded
    token counts; see :func:`attention_bwd_operand_shapes`.

    q (H, Pq, 128) E4M3, q_scale (H, Pq) float32 and k (H, Pk, 128), k_scale (H, Pk/128): the same
    bytes as :class:`AttentionFwdOperands`' q and k; v (H, Pk, 128), v_scale (H, Pk/128): V along
    the head dim, one scale per 128-key tile; qt (H, 128, Pq), qt_scale (H, Pq/128) and kt
    (H, 128, Pk), kt_scale (H, Pk/128): Q and K along tokens (token-contiguous, 32-groups in the
    kernels' fragment order), one scale per 128-token tile. With grouped-query attention (K and V
    with Hkv heads, a divisor of H) k, v, kt and their scales have Hkv heads. Iterating yields the
    ten arrays in that order."""

    __slots__ = _BWD_OPERAND_NAMES
    _quantizer = "quantize_attention_backward"

    def __init__(self, q, q_scale, k, k_scale, v, v_scale, qt, qt_scale, kt, kt_scale):
        self.q, self.q_scale, self.k, self.k_scale, self.v, self.v_scale = q, q_scale, k, k_scale, v, v_scale
        self.qt, self.qt_scale, self.kt, self.kt_scale = qt, qt_scale, kt, kt_scale


def attention_bwd_operand_shapes(q_meta, k_meta, heads, kv_heads=None) -> dict:
    """Shapes of the :class:`AttentionBwdOperands` for q_meta, k_meta, a head count and K/V's
    (kv_heads: None for heads, else a divisor of it), as a dict keyed by the ten names."""
    _check_meta(q_meta, "q_meta")
    _check_meta(k_meta, "k_meta")
    shapes = _C.attention_bwd_operand_shapes(q_meta._host, k_meta._host, int(heads), int(kv_heads or 0))
    return {n: tuple(s) for n, s in zip(_BWD_OPERAND_NAMES, shapes)}


def quantize_attention_backward(q, k, v, q_meta, k_meta, out=None, forward=None) -> AttentionBwdOperands:
    """Quantizes q (Tq, H, 128), k and v (Tk, H, 128), all bfloat16 or all float32, contiguous (the
    forward's inputs), into the backward's operands in the execution layout
    (:class:`AttentionBwdOperands`), one pass per output.

    The values are the MX quantizer's (RCEIL, 32-blocks) re-expressed to coarser power-of-two
    scales, as :func:`attention_backward`'s prepare passes do for MX tensors, except that Q and K
    along tokens get one scale per 128-token tile (per (sequence, channel) there), so each output is
    one pass over its input. :func:`attention_backward_operands` on them skips those passes. Payloads
    come back float8_e4m3fn, scales float32; numpy inputs run the CPU reference, CUDA torch tensors
    five kernels on the current stream. out= an AttentionBwdOperands to write into. forward= the
    :class:`AttentionFwdOperands` that :func:`quantize_attention_forward` wrote from the same inputs:
    its q, q_scale, k, k_scale are the backward's too (the same bytes), so they are taken as they are
    (not copied) and only the other six arrays are written (three kernels instead of five).
    """
    _check_meta(q_meta, "q_meta")
    _check_meta(k_meta, "k_meta")
    q, k, v = _as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v")
    if out is None:
        heads = _heads_of_input(q, q_meta)
        shapes = attention_bwd_operand_shapes(q_meta, k_meta, heads, _kv_heads_of_input(k, k_meta, heads))
        shared = {}
        if forward is not None:
            _operand_arrays(forward, "forward")  # checks its type
            shared = {n: getattr(forward, n) for n in ("q", "q_scale", "k", "k_scale")}
        arrays = tuple(shared[n] if n in shared else
                       _empty(q, shapes[n], "float32" if n.endswith("scale") else _PAYLOAD_DTYPE)
                       for n in _BWD_OPERAND_NAMES)
        out = AttentionBwdOperands(*arrays)
    elif forward is not None:
        raise ValueError("forward: give either out= or forward=, not both")
    arrays = _operand_arrays(out, "out", AttentionBwdOperands)
    _C.quantize_attention_backward(q_meta._cpp_for(q), k_meta._cpp_for(q), _view(q, "q"), _view(k, "k"),
                                   _view(v, "v"), _operand_views(arrays, True, AttentionBwdOperands), forward is None,
                                   _stream(q))
    return out


def quantize_attention_training(q, k, v, q_meta, k_meta, out=None):
    """Both operand sets of a training step from one read of q, k, v: returns (fwd, bwd), the
    :class:`AttentionFwdOperands` that :func:`quantize_attention_forward` writes and the
    :class:`AttentionBwdOperands` that :func:`quantize_attention_backward` writes, the same bytes,
    with bwd's q, q_scale, k, k_scale the very arrays of fwd (the backward's Q' and K' are the
    forward's). Inputs and rules as for those two. CUDA torch tensors: three kernels for bfloat16
    inputs, each reading its input once and writing both of its outputs (six for float32); numpy
    inputs: the CPU reference. out= a (fwd, bwd) pair to write into, bwd's q, q_scale, k, k_scale
    being fwd's arrays.

    Keeping bwd (five bytes per element of Q and K/V, with the scales) from the forward to the
    backward spares the backward a second read of q, k, v, and the caller need not keep them.

    k and v may also be :class:`MxTensor` s along the head dim with plain scales, token-major (e.g.
    gemm_quantize's output viewed as (Tk, H, 128) and (Tk, H, 4)): the bytes are then those of their
    bf16 values (``k.dequantize(k_meta, "bfloat16")``), read once as MX (half the bytes on CUDA).
    """
    _check_meta(q_meta, "q_meta")
    _check_meta(k_meta, "k_meta")
    mx_kv = isinstance(k, MxTensor) or isinstance(v, MxTensor)
    q = _as_array(q, "q")
    if mx_kv:
        karrays, varrays = _mx_arrays(k, "k"), _mx_arrays(v, "v")
    else:
        k, v = _as_array(k, "k"), _as_array(v, "v")
    if out is None:
        heads = _heads_of_input(q, q_meta)
        kv_heads = heads if mx_kv else _kv_heads_of_input(k, k_meta, heads)
        fshapes = attention_fwd_operand_shapes(q_meta, k_meta, heads, kv_heads)
        fwd = AttentionFwdOperands(*(_empty(q, fshapes[n], "float32" if n.endswith("scale") else _PAYLOAD_DTYPE)
                                     for n in _OPERAND_NAMES))
        bshapes = attention_bwd_operand_shapes(q_meta, k_meta, heads, kv_heads)
        bwd = AttentionBwdOperands(*(getattr(fwd, n) if n in ("q", "q_scale", "k", "k_scale") else
                                     _empty(q, bshapes[n], "float32" if n.endswith("scale") else _PAYLOAD_DTYPE)
                                     for n in _BWD_OPERAND_NAMES))
    else:
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError("out: expected a (fwd, bwd) pair of mxflash.AttentionFwdOperands and "
                            "mxflash.AttentionBwdOperands")
        fwd, bwd = out
    farrays = _operand_arrays(fwd, "fwd", AttentionFwdOperands, "fwd")
    barrays = _operand_arrays(bwd, "bwd", AttentionBwdOperands, "bwd")
    fviews = _operand_views(farrays, True, AttentionFwdOperands, "fwd")
    bviews = _operand_views(barrays, True, AttentionBwdOperands, "bwd")
    if mx_kv:
        _C.quantize_attention_training_mx_kv(q_meta._cpp_for(q), k_meta._cpp_for(q), _view(q, "q"),
                                             _mx_view(k, karrays, "k"), _mx_view(v, varrays, "v"), fviews, bviews,
                                             _stream(q))
    else:
        _C.quantize_attention_training(q_meta._cpp_for(q), k_meta._cpp_for(q), _view(q, "q"), _view(k, "k"),
                                       _view(v, "v"), fviews, bviews, _stream(q))
    return fwd, bwd


def attention_backward_operands(ops, out, dout, lse, q_meta, k_meta, softmax_scale=None, broadcast_q=False,
                                dq_accum="fp32", dq_fp16_scale_log2=12, p_scale="constant", output_mxfp8_dkv=False,
                                grads=None, causal=False):
    """:func:`attention_backward` on execution-layout operands (from :func:`quantize_attention_backward`
    with the same q_meta and k_meta): same outputs, options (exact_mx aside; causal must be the
    forward's) and behaviour. numpy
    operands run the exact-MX CPU reference on the operands' values; CUDA torch tensors the fast
    sm_90a kernels without their prepare passes, on the current stream. Grouped-query operands (k,
    v, kt with Hkv heads dividing q's H) give dk, dv (Tk, Hkv, 128) bfloat16, each the sum of its
    group's H/Hkv query heads' gradients (output_mxfp8_dkv is not supported with them).
    """
    _check_meta(q_meta, "q_meta")
    _check_meta(k_meta, "k_meta")
    causal = _causal_code(causal)
    arrays = _operand_arrays(ops, "ops", AttentionBwdOperands)
    qp, kp = arrays[0], arrays[2]
    heads = (int(qp.shape[0]) or 1) if qp.ndim == 3 else 1
    kv_heads = _kv_heads(int(kp.shape[0]) if kp.ndim == 3 else heads, heads)
    o, g, l = _as_array(out, "out"), _as_array(dout, "dout"), _as_array(lse, "lse")
    mx_out = bool(output_mxfp8_dkv)
    outs, scale_views = _backward_outputs(qp, heads, q_meta, k_meta, grads, mx_out, kv_heads)
    dq, dk, dv = outs[:3]
    workspace = ws_ptr = ws_bytes = 0
    if _is_cuda(qp):
        n = _C.attention_backward_operands_workspace_size(q_meta._host, k_meta._host, heads, bool(broadcast_q), mx_out,
                                                          causal, kv_heads)
        workspace, ws_ptr, ws_bytes = _torch_workspace(n, qp.device)
    scale = float("nan") if softmax_scale is None else float(softmax_scale)
    _C.attention_backward_operands(q_meta._cpp_for(qp), k_meta._cpp_for(qp),
                                   _operand_views(arrays, kind=AttentionBwdOperands),
                                   _view(o, "out"), _view(g, "dout"), _view(l, "lse"), scale, bool(broadcast_q),
                                   _code(_DQ_ACCUM, dq_accum), int(dq_fp16_scale_log2), _code(_P_SCALE, p_scale),
                                   mx_out, _view(dq, "dq", True), _view(dk, "dk", True), _view(dv, "dv", True),
                                   *scale_views, ws_ptr, ws_bytes, _stream(qp), causal)
    del workspace  # freed to torch's caching allocator, stream-ordered behind the kernels
    return tuple(outs)


# ---------------------------------------------------------------------------- autograd's step
# mx_attention's host path (mxflash.autograd): the operand sets of a training step in two uint8
# buffers instead of ten arrays, one call each way (the bindings' StepLayout, python/src/module.cpp).
def _attention_step_forward(q, k, v, q_meta, k_meta, softmax_scale, broadcast_q, causal, training):
    """q, k, v (torch, one dtype: bfloat16 or float32, contiguous; k, v with kv heads dividing q's)
    quantized into fresh buffers and attended: (out, lse, saved), saved the backward's operands in one
    uint8 tensor (None without training). causal: the mask's code (_causal_code's)."""
    torch = _torch()
    heads, kv_heads = int(q.shape[1]), int(k.shape[1])
    device = q.device
    n_saved, n_scratch = _C.attention_step_layout(q_meta._host, k_meta._host, heads, kv_heads, bool(training),
                                                  bool(broadcast_q), causal, bool(q.is_cuda))
    saved = torch.empty(max(n_saved, 1), dtype=torch.uint8, device=device)
    scratch = torch.empty(max(n_scratch, 1), dtype=torch.uint8, device=device)
    tokens = q_meta.total_tokens * (k_meta.batch if broadcast_q else 1)
    out = torch.empty((tokens, heads, HEAD_DIM), dtype=torch.bfloat16, device=device)
    lse = torch.empty((heads, tokens), dtype=torch.float32, device=device)
    scale = float("nan") if softmax_scale is None else float(softmax_scale)
    qc, kc = q_meta._cpp_for(q), k_meta._cpp_for(q)
    _C.attention_step_forward(qc, kc, _view(q, "q"), _view(k, "k"), _view(v, "v"), _view(saved, "saved", True),
                              _view(scratch, "scratch", True), _view(out, "out", True), _view(lse, "lse", True),
                              scale, bool(broadcast_q), causal, bool(training), _stream(q))
    del scratch  # V' and the workspace: freed to torch's caching allocator behind the kernels
    return out, lse, (saved if training else None)


def _attention_step_backward(saved, out, dout, lse, q_meta, k_meta, heads, kv_heads, softmax_scale, broadcast_q,
                             causal):
    """The backward of _attention_step_forward's call: (dq, dk, dv) bfloat16, dk and dv with kv_heads;
    causal the mask's code."""
    torch = _torch()
    device = out.device
    dq = torch.empty((q_meta.total_tokens, heads, HEAD_DIM), dtype=torch.bfloat16, device=device)
    dk = torch.empty((k_meta.total_tokens, kv_heads, HEAD_DIM), dtype=torch.bfloat16, device=device)
    dv = torch.empty((k_meta.total_tokens, kv_heads, HEAD_DIM), dtype=torch.bfloat16, device=device)
    workspace = ws_ptr = ws_bytes = 0
    if out.is_cuda:
        n = _C.attention_backward_operands_workspace_size(q_meta._host, k_meta._host, heads, bool(broadcast_q), False,
                                                          causal, kv_heads)
        workspace, ws_ptr, ws_bytes = _torch_workspace(n, device)
    scale = float("nan") if softmax_scale is None else float(softmax_scale)
    _C.attention_step_backward(q_meta._cpp_for(out), k_meta._cpp_for(out), heads, kv_heads,
                               _view(saved, "saved"), _view(out, "out"), _view(dout, "dout"), _view(lse, "lse"),
                               scale, bool(broadcast_q), causal, _view(dq, "dq", True), _view(dk, "dk", True),
                               _view(dv, "dv", True), ws_ptr, ws_bytes, _stream(out))
    del workspace
    return dq, dk, dv


# ---------------------------------------------------------------------------- scalar codecs
# The library's own element and scale rules (include/mxflash/mx.h), vectorized over numpy arrays;
# they exist to test the C++ codecs against independent implementations such as ml_dtypes.
def _f32(a, name):
    a = np.asarray(a)
    if a.dtype.kind not in "fiu" and a.dtype not in (_NP_DTYPES["bfloat16"],):
        raise ValueError(f"{name}: must be a real array, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _bytes(a, name):
    a = np.asarray(a)
    if a.dtype.itemsize != 1 or a.dtype.name not in _BYTE_DTYPES:
        raise ValueError(f"{name}: must be uint8 or a float8 array, got dtype {a.dtype}")
    return np.ascontiguousarray(a).view(np.uint8)


def e4m3_encode(x, saturate=True) -> np.ndarray:
    """float32 -> E4M3 (e4m3fn) bytes, round to nearest even; x is first converted to float32.
    saturate=True clamps finite values and infinities to +-448 (the quantizers' rule);
    saturate=False turns magnitudes that round past 448, and infinities, into NaN (ml_dtypes'
    rule). NaN keeps its sign (0x7F / 0xFF)."""
    src = _f32(x, "x")
    dst = np.empty(src.shape, np.uint8)
    _C.e4m3_encode(src.reshape(-1), dst.reshape(-1), bool(saturate))
    return dst


def e4m3_decode(b) -> np.ndarray:
    """E4M3 bytes (uint8 or float8_e4m3fn) -> float32."""
    src = _bytes(b, "b")
    dst = np.empty(src.shape, np.float32)
    _C.e4m3_decode(src.reshape(-1), dst.reshape(-1))
    return dst


def e8m0_scale(amax, mode="rceil", zero_byte=0) -> np.ndarray:
    """Scale byte for blocks whose largest magnitude is amax (converted to float32).
    rceil: 2^ceil(log2(amax/448)) with the ratio in float32; floor: 2^(floor(log2 amax) - 8).
    NaN or inf amax -> 255; amax == 0 -> zero_byte (0 on the host path, 127 in-kernel)."""
    src = _f32(amax, "amax")
    dst = np.empty(src.shape, np.uint8)
    _C.e8m0_scale(src.reshape(-1), dst.reshape(-1), _code(_C.MODES, mode), int(zero_byte))
    return dst


def e8m0_decode(b) -> np.ndarray:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> float32 2^(b-127) (byte 0: 2^-127; 255: NaN)."""
    src = _bytes(b, "b")
    dst = np.empty(src.shape, np.float32)
    _C.e8m0_decode(src.reshape(-1), dst.reshape(-1))
    return dst
