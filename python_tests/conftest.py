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
