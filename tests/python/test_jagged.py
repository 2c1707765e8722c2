"""JaggedMeta from Python: construction, properties and validation (messages from the C++ library)."""
import importlib.util

import numpy as np
import pytest

import mxflash


def test_from_lengths_properties():
    m = mxflash.JaggedMeta.from_lengths([17, 0, 129])
    assert m.batch == 3 and m.total_tokens == 146 and m.padded_tokens == 384 and m.max_seqlen == 129
    assert m.cu_seqlens.dtype == np.int32 and m.cu_seqlens_sf.dtype == np.int32
    assert list(m.cu_seqlens) == [0, 17, 17, 146]
    assert list(m.cu_seqlens_sf) == [0, 128, 128, 384]
    assert list(m.lengths) == [17, 0, 129]
    assert "total_tokens=146" in repr(m)


@pytest.mark.parametrize("lengths", [[0, 1, 31, 32, 33, 127, 128, 129, 1000], [0], [5]])
def test_from_cu_seqlens_matches_from_lengths(lengths):
    a = mxflash.JaggedMeta.from_lengths(np.array(lengths, dtype=np.int64))
    b = mxflash.JaggedMeta.from_cu_seqlens(a.cu_seqlens)
    c = mxflash.JaggedMeta.from_cu_seqlens(a.cu_seqlens, cu_seqlens_sf=a.cu_seqlens_sf)
    want_sf = np.concatenate([[0], np.cumsum([-(-n // 128) * 128 for n in lengths])])
    for m in (a, b, c):
        assert np.array_equal(m.cu_seqlens, np.concatenate([[0], np.cumsum(lengths)]))
        assert np.array_equal(m.cu_seqlens_sf, want_sf)
        assert m.max_seqlen == max(lengths) and m.batch == len(lengths)


def test_properties_are_copies():
    m = mxflash.JaggedMeta.from_lengths([3, 4])
    m.cu_seqlens[1] = 99
    assert list(m.cu_seqlens) == [0, 3, 7]


def test_direct_construction_is_refused():
    with pytest.raises(TypeError, match="from_lengths"):
        mxflash.JaggedMeta()


@pytest.mark.parametrize("call,message", [
    (lambda: mxflash.JaggedMeta.from_lengths([]), "lengths: must hold at least one sequence"),
    (lambda: mxflash.JaggedMeta.from_lengths([3, -1]), "lengths[1]: must be >= 0, got -1"),
    (lambda: mxflash.JaggedMeta.from_lengths([2**31]),
     "lengths: the 128-padded total token count must fit in int32"),
    (lambda: mxflash.JaggedMeta.from_cu_seqlens([1, 5]), "cu_seqlens: must start at 0, got 1"),
    (lambda: mxflash.JaggedMeta.from_cu_seqlens([0, 5, 3]),
     "cu_seqlens: must be monotone non-decreasing (entry 2 = 3 < 5)"),
    (lambda: mxflash.JaggedMeta.from_cu_seqlens([0]), "cu_seqlens: needs B+1 >= 2 entries"),
    (lambda: mxflash.JaggedMeta.from_cu_seqlens([0, 2**31]), "cu_seqlens: entry 1 = 2147483648 does not fit in int32"),
    (lambda: mxflash.JaggedMeta.from_cu_seqlens([0, 17, 146], cu_seqlens_sf=[0, 128, 256]),
     "cu_seqlens_sf: entry 2 is 256, but the prefix sum of lengths rounded up to 128 is 384"),
    (lambda: mxflash.JaggedMeta.from_cu_seqlens([0, 17], cu_seqlens_sf=[0, 128, 128]),
     "cu_seqlens_sf: must have as many entries as cu_seqlens (2)"),
])
def test_bad_metadata_raises_value_error_with_the_library_message(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value) == message


def test_non_integer_or_multidimensional_lengths():
    with pytest.raises(ValueError, match="^lengths: must hold integers, got dtype float64$"):
        mxflash.JaggedMeta.from_lengths([1.5, 2.0])
    with pytest.raises(ValueError, match=r"^cu_seqlens: must be 1-D, got shape \(2, 2\)$"):
        mxflash.JaggedMeta.from_cu_seqlens([[0, 1], [2, 3]])


def test_upload_error_is_runtime_error():
    m = mxflash.JaggedMeta.from_lengths([3])
    if mxflash.cuda_built():
        with pytest.raises(RuntimeError, match="^cuda(Get|Set)Device: "):
            m.upload(10_000)  # no such device
    else:
        with pytest.raises(RuntimeError, match="^mxflash was built without CUDA$"):
            m.upload(0)


def test_torch_cpu_tensor_lengths():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import torch
    m = mxflash.JaggedMeta.from_lengths(torch.tensor([4, 0, 200], dtype=torch.int32))
    assert list(m.cu_seqlens_sf) == [0, 128, 128, 384]
    m = mxflash.JaggedMeta.from_cu_seqlens(torch.tensor([0, 4, 4, 204]))
    assert m.max_seqlen == 200
