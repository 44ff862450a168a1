"""Where the CUDA toolkit is, for setup.py (kept apart so that python_tests/integration/test_build.py can test it).

The nvcc on PATH may be a wrapper script or a link outside the toolkit's folder (e.g. /usr/local/bin/nvcc that runs
/usr/local/cuda-13.0/bin/nvcc): torch's own guess, the folder above the nvcc on PATH, then holds no CUDA libraries
and the link fails with "cannot find -lcudart". nvcc itself knows its toolkit (``TOP`` in ``nvcc -v --dryrun``).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys


def is_toolkit(folder: str | None) -> bool:
    """A CUDA toolkit folder: nvcc in bin/ and the CUDA runtime library (what the link needs, -lcudart) in lib64/
    or lib/ (the folders torch's CUDAExtension links from)."""
    if not folder:
        return False
    libs = [f for d in ("lib64", "lib") for f in glob.glob(os.path.join(folder, d, "libcudart.*"))]
    return os.path.isfile(os.path.join(folder, "bin", "nvcc")) and bool(libs)


def nvcc_reported_home(nvcc: str) -> str | None:
    """The toolkit folder of the nvcc on PATH as nvcc itself reports it (``TOP`` of ``nvcc -v --dryrun``). The nvcc
    on PATH may be a wrapper script or link outside the toolkit (e.g. /usr/local/bin/nvcc running
    /usr/local/cuda-13.0/bin/nvcc), so the folder above it is not necessarily the toolkit."""
    try:
        res = subprocess.run(
            [nvcc, "-v", "--dryrun", "-x", "cu", "-E", os.devnull], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    here = None
    for line in (res.stdout + res.stderr).splitlines():
        line = line.removeprefix("#$").strip()
        if line.startswith("TOP="):
            return os.path.normpath(line[4:].strip())
        if line.startswith("_HERE_="):
            here = os.path.dirname(os.path.normpath(line[7:].strip()))
    return here


def find_cuda_home(torch_guess: str | None = None) -> tuple[str | None, list[str]]:
    """``(toolkit folder or None, the candidates tried)``: the toolkit of the nvcc on PATH as nvcc reports it (then
    the folder above the resolved nvcc path), then CUDA_HOME / CUDA_PATH, then torch's guess; the first that holds
    nvcc and libcudart."""
    candidates: list[tuple[str, str]] = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        reported = nvcc_reported_home(nvcc)
        if reported:
            candidates.append((reported, f"nvcc -v --dryrun of {nvcc}"))
        candidates.append((os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), f"the folder of {nvcc}"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append((os.environ[var], var))
    if torch_guess:
        candidates.append((torch_guess, "torch.utils.cpp_extension.CUDA_HOME"))
    tried, seen = [], set()
    for folder, source in candidates:
        if os.path.realpath(folder) in seen:
            continue
        seen.add(os.path.realpath(folder))
        if is_toolkit(folder):
            others = {os.environ[v] for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)} - {folder}
            note = f"; CUDA_HOME/CUDA_PATH {sorted(others)} not used" if others else ""
            print(f"sbd_ext: CUDA toolkit {folder} (from {source}{note})", file=sys.stderr)
            return folder, tried
        tried.append(f"{folder} (from {source})")
    return None, tried


class ToolkitError(RuntimeError):
    """The CUDA kernels are wanted (or required) and cannot be built: the message says why and what to set."""


def cuda_build_home(mode: str, torch_version: str, torch_cuda: str | None, torch_guess: str | None) -> str | None:
    """The CUDA toolkit to build the CUDA kernels with, or None for a CPU-only build.

    mode: SBD_EXT_CUDA ("auto", "1"/"on"/"true"/"yes", "0"/"off"/"false"/"no"). A CPU torch, or (auto) a CUDA torch
    with no nvcc on PATH and neither CUDA_HOME nor CUDA_PATH set, builds the CPU kernels (announced on stderr). A
    CUDA torch with nvcc or one of those variables, but no folder of them holding a toolkit, raises
    :class:`ToolkitError` naming the folders tried; so does mode 1 when CUDA cannot be built."""
    mode = mode.strip().lower()
    if mode in ("0", "off", "false", "no"):
        return None
    if mode not in ("auto", "", "1", "on", "true", "yes"):
        raise ToolkitError(f"SBD_EXT_CUDA={mode!r}: expected auto, 1 or 0")
    required = mode in ("1", "on", "true", "yes")
    if torch_cuda is None:
        if required:
            raise ToolkitError(
                f"SBD_EXT_CUDA=1 but the CUDA kernels cannot be built: torch {torch_version} is a CPU-only build."
            )
        print(
            f"sbd_ext: building the CPU kernels only (torch {torch_version} has no CUDA); "
            "set SBD_EXT_CUDA=1 to require CUDA.",
            file=sys.stderr,
        )
        return None
    home, tried = find_cuda_home(torch_guess)
    if home is not None:
        return home
    named = shutil.which("nvcc") or os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not named and not required:
        print(
            f"sbd_ext: building the CPU kernels only (torch {torch_version} is a CUDA build, but no nvcc is on PATH "
            "and neither CUDA_HOME nor CUDA_PATH is set); set SBD_EXT_CUDA=1 to require CUDA.",
            file=sys.stderr,
        )
        return None
    raise ToolkitError(
        f"sbd_ext: torch {torch_version} is a CUDA {torch_cuda} build, but no CUDA toolkit (bin/nvcc and "
        "lib64/libcudart) was found: "
        + ("; ".join(tried) if tried else "no nvcc on PATH, CUDA_HOME and CUDA_PATH unset")
        + ". Set CUDA_HOME to the toolkit's folder (e.g. /usr/local/cuda-13.0), or SBD_EXT_CUDA=0 to build the CPU "
        "kernels only."
    )
