import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # python_tests/utils.py

from utils import DEVICES  # noqa: E402

import sbd_ext  # noqa: E402


@pytest.fixture(params=DEVICES)
def device(request):
    """Every op test runs on the CPU and, where an NVIDIA GPU and the CUDA kernels are present, on CUDA."""
    return torch.device(request.param)


@pytest.fixture(params=sbd_ext.build_info()["cpu_isas"])
def cpu_isa(request):
    """Run a CPU test under each CPU kernel variant (default / avx2 / avx512) this machine can execute."""
    sbd_ext._C.set_cpu_isa(request.param)
    yield request.param
    sbd_ext._C.set_cpu_isa("")


_CUDA_KERNELS = sbd_ext.build_info()["cuda"] and torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _no_pending_cuda_length_error():
    """On CUDA an invalid block_attention length is reported by the next call (the lengths stay on the device), so a
    test that leaves one behind would fail an unrelated later test (the first H200 run showed exactly that). Each
    test that makes an invalid CUDA call takes its error (sbd_ext.ops.check_cuda_errors); one left over fails the
    test that left it, and is cleared."""
    yield
    if not (_CUDA_KERNELS and torch.cuda.is_initialized()):
        return
    torch.cuda.synchronize()
    msg = sbd_ext._C.take_cuda_error()
    if msg:
        pytest.fail(f"the test left a pending CUDA block_attention error (take it with check_cuda_errors): {msg}")
