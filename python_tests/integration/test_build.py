"""The build's configuration (setup.py, tools/cuda_toolkit.py): the CUDA toolkit is found through an nvcc wrapper
with no environment variable set, a missing toolkit is a clear error, and setuptools' package list is complete."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import cuda_toolkit  # noqa: E402
import link_flags  # noqa: E402
import unity_build  # noqa: E402


def _toolkit(folder: Path, with_cudart: bool = True) -> Path:
    """A fake toolkit: bin/nvcc answering ``-v --dryrun`` as nvcc does (``#$ TOP=<its bin>/..``), lib64/libcudart."""
    (folder / "bin").mkdir(parents=True)
    nvcc = folder / "bin" / "nvcc"
    here = folder / "bin"
    nvcc.write_text(f'#!/bin/sh\necho "#\\$ _HERE_={here}" >&2\necho "#\\$ TOP={here}/.." >&2\n')
    nvcc.chmod(0o755)
    if with_cudart:
        (folder / "lib64").mkdir()
        (folder / "lib64" / "libcudart.so").write_bytes(b"")
    return folder


def _wrapper(folder: Path, target: Path) -> Path:
    """An nvcc on PATH that is a script outside the toolkit (as /usr/local/bin/nvcc on the CPU machines)."""
    folder.mkdir(parents=True)
    (folder / "nvcc").write_text(f'#!/bin/sh\nexec {target / "bin" / "nvcc"} "$@"\n')
    (folder / "nvcc").chmod(0o755)
    return folder


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    return monkeypatch


def test_toolkit_found_through_an_nvcc_wrapper(tmp_path, clean_env):
    kit = _toolkit(tmp_path / "cuda-13.0")
    wrapper = _wrapper(tmp_path / "usr" / "bin", kit)
    clean_env.setenv("PATH", str(wrapper))
    torch_guess = str(wrapper.parent)  # torch's guess: the folder above the nvcc on PATH (no libcudart there)
    assert not cuda_toolkit.is_toolkit(torch_guess)
    home, _ = cuda_toolkit.find_cuda_home(torch_guess)
    assert Path(home).resolve() == kit.resolve()
    assert Path(cuda_toolkit.cuda_build_home("auto", "2.14.1", "13.0", torch_guess)).resolve() == kit.resolve()


def test_cuda_home_is_used_when_nvcc_leads_nowhere(tmp_path, clean_env):
    kit = _toolkit(tmp_path / "cuda")
    clean_env.setenv("PATH", str(tmp_path / "empty"))
    clean_env.setenv("CUDA_HOME", str(kit))
    assert cuda_toolkit.find_cuda_home(None)[0] == str(kit)


def test_no_toolkit_is_a_clear_error(tmp_path, clean_env):
    kit = _toolkit(tmp_path / "cuda-13.0", with_cudart=False)  # nvcc, but no CUDA runtime library
    clean_env.setenv("PATH", str(_wrapper(tmp_path / "usr" / "bin", kit)))
    with pytest.raises(cuda_toolkit.ToolkitError, match=r"no CUDA toolkit .*cuda-13.0.*Set CUDA_HOME"):
        cuda_toolkit.cuda_build_home("auto", "2.14.1", "13.0", str(tmp_path / "usr"))
    assert cuda_toolkit.cuda_build_home("0", "2.14.1", "13.0", None) is None  # SBD_EXT_CUDA=0: CPU only, no error


def test_cpu_builds_without_a_toolkit(tmp_path, clean_env):
    clean_env.setenv("PATH", str(tmp_path / "empty"))
    assert cuda_toolkit.cuda_build_home("auto", "2.14.1", "13.0", None) is None  # no nvcc, nothing named: CPU
    assert cuda_toolkit.cuda_build_home("auto", "2.13.0+cpu", None, None) is None  # a CPU torch
    with pytest.raises(cuda_toolkit.ToolkitError, match="CPU-only build"):
        cuda_toolkit.cuda_build_home("1", "2.13.0+cpu", None, None)
    with pytest.raises(cuda_toolkit.ToolkitError, match="no CUDA toolkit"):
        cuda_toolkit.cuda_build_home("1", "2.14.1", "13.0", None)
    with pytest.raises(cuda_toolkit.ToolkitError, match="SBD_EXT_CUDA='maybe'"):
        cuda_toolkit.cuda_build_home("maybe", "2.14.1", "13.0", None)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
def test_this_machines_nvcc_leads_to_its_toolkit(clean_env):
    home, tried = cuda_toolkit.find_cuda_home(None)
    assert home is not None, tried
    assert cuda_toolkit.is_toolkit(home)


def test_setuptools_sees_every_package(tmp_path):
    """build_py lists every importable folder of sbd_ext (custom_generate, transformers' remote-code folder, too):
    no 'absent from the packages configuration' warning, and custom_generate's files are installed."""
    env = {**os.environ, "SBD_EXT_CUDA": "0", "PYTHONWARNINGS": "default"}
    r = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "absent from the `packages` configuration" not in r.stdout + r.stderr
    gen = tmp_path / "out" / "sbd_ext" / "integration" / "custom_generate"
    assert (gen / "generate.py").is_file() and (gen / "requirements.txt").is_file()


def test_link_flags_name_the_shared_libstdcxx_where_the_search_path_has_only_the_archive(tmp_path):
    """The GPU image's toolchain (/opt/gcc, found on the H200) searches a folder holding only libstdc++.a first, so
    -lstdc++ linked a private static copy. Reproduced with -L to such a folder: -lstdc++ alone gives a library
    without libstdc++.so in NEEDED; tools/link_flags.py's flags (torch's shared libstdc++ by path) give it."""
    gxx = shutil.which("g++")
    assert gxx, "g++ is part of the build toolchain"
    archive = subprocess.run([gxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    assert os.path.isabs(archive) and os.path.isfile(archive), archive
    static_only = tmp_path / "static_only"
    static_only.mkdir()
    (static_only / "libstdc++.a").symlink_to(archive)
    src = tmp_path / "fmt.cpp"
    src.write_text(
        "#include <sstream>\n#include <string>\nstd::string f(int x){std::ostringstream o;o<<x;return o.str();}\n"
    )
    flags = link_flags.link_flags(["-lstdc++"])
    assert flags != ["-lstdc++"] and os.path.basename(flags[0]).startswith("libstdc++.so"), flags

    def needed(extra):
        out = tmp_path / "fmt.so"
        subprocess.run([gxx, "-shared", "-fPIC", str(src), "-o", str(out), f"-L{static_only}", *extra], check=True)
        return subprocess.run(["readelf", "-d", str(out)], capture_output=True, text=True, check=True).stdout

    assert "[libstdc++.so" not in needed(["-lstdc++"])  # the image's failure, reproduced
    assert "[libstdc++.so" in needed(flags)
    # a machine where none is mapped (or not Linux): the config's flag unchanged
    assert link_flags.link_flags(["-lstdc++", "-x"], maps_path=str(tmp_path / "absent")) == ["-lstdc++", "-x"]


def test_extension_links_the_shared_libstdcxx():
    """The built extension uses the process's shared libstdc++ (setup.py's link_flags). A g++ that links it
    statically (the GPU image's /opt/gcc/bin/g++) gave _C a private copy whose number formatting broke inside torch's
    process: error messages lost their numbers here, and the H200 run segfaulted formatting the first error."""
    readelf = shutil.which("readelf")
    assert readelf, "binutils' readelf is part of the build toolchain"
    import sbd_ext

    dynamic = subprocess.run([readelf, "-d", sbd_ext._C.__file__], capture_output=True, text=True, check=True).stdout
    assert "[libstdc++.so" in dynamic, dynamic
    # and what the private copy broke: a number in a C++ error message
    q, kv, cache = torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 4, 8)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cache_lens\[0\] \+ n_commit\[0\] = 9 \+ 1 exceeds the cache size"):
        sbd_ext.block_attention(q, kv, kv, cache, cache.clone(), one * 9, one, one)


def test_unity_file_includes_every_host_source_and_is_rewritten_only_when_its_list_changes(tmp_path):
    srcs = ["csrc/ops.cpp", "csrc/cpu/isa.cpp", "csrc/cpu/x_cpu.cpp", "csrc/cuda/x_launch.cu"]
    out = unity_build.unity_sources(srcs, str(tmp_path / "b"), environ={})
    unity = tmp_path / "b" / unity_build.FILE_NAME
    assert out == [str(unity), "csrc/cuda/x_launch.cu"]
    includes = [ln for ln in unity.read_text().splitlines() if ln.startswith("#include")]
    assert includes == [f'#include "{os.path.abspath(s)}"' for s in srcs[:3]]
    os.utime(unity, (1, 1))  # the same list again: the file (and so ninja's view of it) is left alone
    unity_build.unity_sources(srcs, str(tmp_path / "b"), environ={})
    assert unity.stat().st_mtime == 1
    unity_build.unity_sources(srcs[1:], str(tmp_path / "b"), environ={})
    assert unity.stat().st_mtime != 1 and "ops.cpp" not in unity.read_text()
    # SBD_EXT_UNITY=0, or a single C++ source: the sources as they are, nothing generated.
    assert unity_build.unity_sources(srcs, str(tmp_path / "c"), environ={"SBD_EXT_UNITY": "0"}) == srcs
    assert unity_build.unity_sources(srcs[2:], str(tmp_path / "d"), environ={}) == srcs[2:]
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_host_sources_leak_no_macro_or_namespace_into_each_other():
    """Compiled as one translation unit, a file-scope #define or `using namespace` in one host source would change
    the meaning of the ones after it without an error."""
    files = [ROOT / f for f in unity_build.host_sources(ROOT, with_cuda=True)]  # what setup.py compiles as one
    assert {f.name for f in files} >= {"ops.cpp", "block_attention_cpu.cpp", "block_attention_cuda.cpp"}, files
    assert not any(f.name.endswith("_kernel.cpp") for f in files), files
    for f in files:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            stripped = line.strip()
            assert not stripped.startswith("#define"), f"{f}:{n}: {stripped}"
            assert not stripped.startswith("using namespace"), f"{f}:{n}: {stripped}"
