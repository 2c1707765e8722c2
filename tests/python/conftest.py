"""Shared fixtures of the Python tests."""
import importlib.util
import os

import pytest

import mxflash


def cuda_skip_reason():
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if not mxflash.cuda_built():
        return "mxflash was built without CUDA"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"the kernels are built for sm_90a (Hopper), the device is sm_{major}{minor}"
    return None


@pytest.fixture(scope="module")
def torch_cuda():
    """torch with a Hopper GPU, or a skip (a failure with MXFLASH_REQUIRE_CUDA=1) saying why not."""
    reason = cuda_skip_reason()
    if reason:
        if os.environ.get("MXFLASH_REQUIRE_CUDA") == "1":
            pytest.fail(f"MXFLASH_REQUIRE_CUDA=1 but {reason}")
        pytest.skip(reason)
    import torch
    return torch
