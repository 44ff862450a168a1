"""Build of the sbd_ext C++/CUDA extension (sbd_ext._C) against the torch that is installed.

Environment variables:
  SBD_EXT_CUDA        auto (default) | 1 | 0. auto builds the CUDA kernels when torch is a CUDA build and nvcc
                      is found; 1 requires them (fails if impossible); 0 builds the CPU kernels only.
  SBD_EXT_CUDA_ARCH   CUDA architectures, TORCH_CUDA_ARCH_LIST syntax (default: cuda_archs of tools/build_config.json,
                      "8.0;9.0a"). It wins over an environment TORCH_CUDA_ARCH_LIST; without it, that variable is
                      used if set. The build log says which list was used and where it came from.
  SBD_EXT_DEBUG       1 builds with -O0 -g and host-side asserts.
  SBD_EXT_NATIVE      1 adds -march=native to the (ISA-independent) C++ sources.
  SBD_EXT_ISAS        a comma-separated subset of DEFAULT,AVX2,AVX512 (with DEFAULT): the CPU kernel variants to build.
  SBD_EXT_UNITY       0 compiles the host C++ sources one by one (default: as one translation unit, see below).
  MAX_JOBS            parallel compile jobs (ninja), as for every torch extension.
  CUDA_HOME/CUDA_PATH the CUDA toolkit, when the nvcc on PATH does not lead to one (see below).

The CUDA toolkit (for a CUDA torch) is found without any variable set: the folder the nvcc on PATH reports as its
own (``nvcc -v --dryrun``: a wrapper script or link elsewhere leads to the real toolkit), then CUDA_HOME /
CUDA_PATH, then torch's guess; the first folder holding bin/nvcc and lib64/libcudart is used (the build log names
it). When nvcc or one of those variables is there but none leads to a toolkit, the build stops and says so.

CPU kernels (csrc/cpu/*_kernel.cpp) are compiled once per instruction set (DEFAULT, and AVX2 / AVX512 on x86-64)
into namespaces sbd_cpu::<ISA>; the bindings pick the widest one the running CPU supports (csrc/cpu/isa.h), as
ATen does for its own kernels. The rest of the extension is compiled for the baseline ISA, so the wheel runs on
any x86-64 machine, and as one translation unit (a generated file that #includes each host source: torch's headers
are parsed once, not once per file: tools/unity_build.py; SBD_EXT_UNITY=0 compiles them one by one).

Compiler flags and the default CUDA architectures come from tools/build_config.json, shared with CMakeLists.txt and
csrc/cuda/compile_check.sh.
"""

import glob
import json
import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import find_packages, setup

try:
    import torch
    import torch.utils.cpp_extension as _cpp_extension
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError:  # pragma: no cover - only on a machine without torch
    sys.exit(
        "sbd_ext builds against the torch that is installed, and none is. Install it first:\n"
        "  pip install torch==2.13.0        # CPU machine (the pinned wheel)\n"
        "  pip install torch                # or your CUDA build of torch\n"
        "then: pip install .   (or pip install --no-build-isolation .)"
    )

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import cuda_toolkit  # noqa: E402  (tools/cuda_toolkit.py: whether to build CUDA, and where its toolkit is)
import link_flags  # noqa: E402  (tools/link_flags.py: -lstdc++ as the path of torch's shared libstdc++)
import unity_build  # noqa: E402  (tools/unity_build.py: the host sources as one translation unit)

with open(os.path.join(ROOT, "tools", "build_config.json")) as _f:
    CONFIG = json.load(_f)


def _cuda_wanted() -> bool:
    """Whether to build the CUDA kernels (SBD_EXT_CUDA, torch's build, the toolkit: tools/cuda_toolkit.py); when
    yes, torch's build is pointed at the toolkit found (its module-level CUDA_HOME: nvcc, includes, libraries)."""
    try:
        home = cuda_toolkit.cuda_build_home(
            os.environ.get("SBD_EXT_CUDA", "auto"), torch.__version__, torch.version.cuda, _cpp_extension.CUDA_HOME
        )
    except cuda_toolkit.ToolkitError as e:
        sys.exit(str(e))
    if home is None:
        return False
    _cpp_extension.CUDA_HOME = home
    os.environ["CUDA_HOME"] = home
    return True


# Per-ISA flags (tools/build_config.json); the macros select at::vec's implementation (ATen/cpu/vec/vec.h).
ISA_FLAGS = CONFIG["isa_flags"]


def _cuda_arch_list() -> str:
    """SBD_EXT_CUDA_ARCH, else TORCH_CUDA_ARCH_LIST, else tools/build_config.json; never silently another one."""
    env_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    chosen, source = os.environ.get("SBD_EXT_CUDA_ARCH"), "SBD_EXT_CUDA_ARCH"
    if not chosen and env_list:
        chosen, source = env_list, "TORCH_CUDA_ARCH_LIST"
    if not chosen:
        chosen, source = ";".join(CONFIG["cuda_archs"]), "tools/build_config.json"
    note = f" (TORCH_CUDA_ARCH_LIST={env_list!r} is overridden)" if env_list and env_list != chosen else ""
    print(f"sbd_ext: CUDA architectures {chosen} from {source}{note}", file=sys.stderr)
    return chosen


def _isas():
    """The CPU kernel variants to compile: all the machine family has, or the subset SBD_EXT_ISAS names
    (comma-separated; DEFAULT, the fallback every CPU runs, must be among them)."""
    available = ["DEFAULT", "AVX2", "AVX512"] if platform.machine().lower() in ("x86_64", "amd64") else ["DEFAULT"]
    wanted = [x.strip().upper() for x in os.environ.get("SBD_EXT_ISAS", "").split(",") if x.strip()]
    if not wanted:
        return available
    unknown = [x for x in wanted if x not in available]
    if unknown or "DEFAULT" not in wanted:
        sys.exit(f"SBD_EXT_ISAS={os.environ['SBD_EXT_ISAS']!r}: a comma-separated subset of {available} with DEFAULT")
    return [x for x in available if x in wanted]


class BuildExtWithISA(BuildExtension):
    """BuildExtension plus the per-ISA compilation of the CPU kernel sources (see the module docstring)."""

    def build_extension(self, ext):
        from torch.utils.cpp_extension import include_paths

        kernels = sorted(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*_kernel.cpp")))
        headers = glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True)
        newest_input = max(os.path.getmtime(f) for f in kernels + headers + [__file__])
        out_dir = os.path.join(os.path.abspath(self.build_temp), "isa")
        os.makedirs(out_dir, exist_ok=True)
        cxx = os.environ.get("CXX", "c++")
        debug = os.environ.get("SBD_EXT_DEBUG", "0") == "1"
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        base = [f"-std={CONFIG['cxx_std']}", "-fPIC", *CONFIG["openmp_flags"], f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
        base += CONFIG["cxx_debug_flags"] if debug else [*CONFIG["cxx_flags"], "-DNDEBUG"]
        base += [f"-I{p}" for p in ext.include_dirs + include_paths()]
        jobs, objects = [], []
        for src in kernels:
            stem = os.path.splitext(os.path.basename(src))[0]
            for isa in _isas():
                wrapper = os.path.join(out_dir, f"{stem}.{isa}.cpp")
                obj = os.path.join(out_dir, f"{stem}.{isa}.o")
                objects.append(obj)
                if os.path.exists(obj) and os.path.getmtime(obj) > newest_input:
                    continue
                with open(wrapper, "w") as f:
                    f.write(f'#define CPU_CAPABILITY {isa}\n#include "{src}"\n')
                jobs.append([cxx, "-c", wrapper, "-o", obj, *base, *ISA_FLAGS[isa]])
        ext.extra_objects = list(ext.extra_objects or []) + objects
        ext.define_macros = list(ext.define_macros or []) + [(f"SBD_EXT_HAVE_{isa}", "1") for isa in _isas()]
        ext.sources = unity_build.unity_sources(ext.sources, self.build_temp)
        # The kernel variants compile (MAX_JOBS at a time) while ninja compiles the sources (one translation unit),
        # and the link waits for them.
        workers = int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
        pool = ThreadPoolExecutor(max(1, workers))
        runs = [pool.submit(subprocess.run, c, capture_output=True, text=True) for c in jobs]

        def kernels_built():
            for cmd, run in zip(jobs, runs, strict=True):
                res = run.result()
                if res.returncode != 0:
                    sys.stderr.write(res.stdout + res.stderr)
                    raise RuntimeError(f"compiling {cmd[2]} failed")

        link = self.compiler.link_shared_object
        self.compiler.link_shared_object = lambda *a, **k: (kernels_built(), link(*a, **k))[1]
        try:
            super().build_extension(ext)
            kernels_built()  # also where setuptools found the extension up to date and linked nothing
        finally:
            del self.compiler.link_shared_object  # the class's method again
            pool.shutdown(wait=True)


def _extension():
    debug = os.environ.get("SBD_EXT_DEBUG", "0") == "1"
    with_cuda = _cuda_wanted()
    sources = unity_build.host_sources(ROOT, with_cuda)  # the *_kernel.cpp are built per ISA by BuildExtWithISA
    # -g0 in a release build: Python's CFLAGS (which torch's build passes first) carry -g, and debug information
    # for torch's headers made the bindings' compile 1.4x slower and the object 29x larger.
    cxx = list(CONFIG["cxx_debug_flags"] if debug else [*CONFIG["cxx_flags"], "-g0"])
    # AVX-512/AVX2 code paths come from ATen's vectorised types (at::vec), which pick the widest ISA the
    # compiler is allowed; -march=native would make the wheel unportable, so it is opt-in.
    if os.environ.get("SBD_EXT_NATIVE", "0") == "1":
        cxx.append("-march=native")
    cxx += CONFIG["openmp_flags"]
    include_dirs = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include")]
    kwargs = dict(
        name="sbd_ext._C",
        sources=sources,
        include_dirs=include_dirs,
        # The shared libstdc++ torch runs with, named by path (tools/link_flags.py says why).
        extra_link_args=CONFIG["openmp_flags"] + link_flags.link_flags(CONFIG["link_flags"]),
    )
    if not with_cuda:
        kwargs["extra_compile_args"] = {"cxx": cxx}
        return CppExtension(**kwargs)
    # Set, not setdefault: an environment TORCH_CUDA_ARCH_LIST must not replace the chosen list unannounced.
    os.environ["TORCH_CUDA_ARCH_LIST"] = _cuda_arch_list()
    # The torch-facing bindings are host C++ (*_cuda.cpp, among the sources above: the host compiler, in the one
    # translation unit); nvcc compiles only the kernels and their launchers (*_launch.cu, no torch headers).
    kwargs["sources"] += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    # torch's CUDAExtension adds the __CUDA_NO_* defines (nvcc_defines of the config) itself.
    nvcc = [*(CONFIG["nvcc_debug_flags"] if debug else CONFIG["nvcc_flags"]), "-DSBD_EXT_WITH_CUDA"]
    kwargs["extra_compile_args"] = {"cxx": cxx + ["-DSBD_EXT_WITH_CUDA"], "nvcc": nvcc}
    return CUDAExtension(**kwargs)


setup(
    # custom_generate is transformers' remote-code folder (generate.py + requirements.txt, no __init__.py): listed
    # as a package of its own so that setuptools installs its module and data without an "absent from the packages
    # configuration" warning.
    packages=find_packages(include=["sbd_ext", "sbd_ext.*"]) + ["sbd_ext.integration.custom_generate"],
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtWithISA.with_options(use_ninja=True)},
)
