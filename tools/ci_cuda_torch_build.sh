#!/usr/bin/env bash
# CI step: what a GPU user's `pip install .` does, on a machine without a GPU. In a venv of its own: the CUDA build
# of torch (2.14.1, CUDA 13; the wheel and its nvidia-* libraries lie on the CI machines' disk for pip's local
# index), then this package built from a copy of the working tree with the full CUDA extension (SBD_EXT_CUDA=1: a
# CPU-only build is an error) for one architecture, with no CUDA_HOME / CUDA_PATH set (setup.py finds the toolkit
# through the nvcc on PATH), linked, imported, and a CPU smoke test of the four ops against sbd_ext.reference
# (tools/cuda_torch_smoke.py; torch.cuda.is_available() is False here).
#
# Environment: SBD_CUDA_TORCH (default torch==2.14.1), SBD_EXT_CUDA_ARCH (default 9.0a), MAX_JOBS (default 2),
# SBD_EXT_ISAS (default DEFAULT: one CPU kernel variant; what this step checks is the CUDA build against a CUDA torch,
# the CPU variants are built and tested by the README's test command), SBD_CUDA_BUILD_DIR (default
# build-ci-cuda-torch: the venv, the source copy and the build log).
# pip, not uv: pip resolves the wheels on disk; uv would download the CUDA wheels (~3 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=${SBD_CUDA_BUILD_DIR:-$root/build-ci-cuda-torch}
torch_spec=${SBD_CUDA_TORCH:-torch==2.14.1}
python=${PYTHON:-python3}
export SBD_EXT_CUDA_ARCH=${SBD_EXT_CUDA_ARCH:-9.0a} MAX_JOBS=${MAX_JOBS:-2} SBD_EXT_ISAS=${SBD_EXT_ISAS:-DEFAULT}

command -v nvcc >/dev/null || { echo "ci_cuda_torch_build: no nvcc on PATH" >&2; exit 1; }
rm -rf "$work"
mkdir -p "$work/src"
start=$SECONDS
"$python" -m venv "$work/venv"
py=$work/venv/bin/python
if ! "$py" -m pip install -q "$torch_spec" numpy >"$work/torch-install.log" 2>&1; then
  grep -v "^WARNING: Location" "$work/torch-install.log" | tail -40 >&2
  echo "ci_cuda_torch_build: installing $torch_spec failed" >&2
  exit 1
fi
"$py" -c "import torch; assert torch.version.cuda, torch.__version__; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
echo "venv + CUDA torch in $((SECONDS - start)) s"

# The tracked (and new, not ignored) files of the working tree: no in-place build output of the checkout is reused
# and none is overwritten (the checkout's build/ belongs to its own CPU torch).
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  if [ -f "$f" ]; then mkdir -p "$work/src/$(dirname "$f")" && cp -p "$f" "$work/src/$f"; fi
done

start=$SECONDS
log=$work/build.log
if ! env -u CUDA_HOME -u CUDA_PATH -u TORCH_CUDA_ARCH_LIST SBD_EXT_CUDA=1 \
  "$py" -m pip install -v "$work/src" >"$log" 2>&1; then
  grep -v "^WARNING: Location" "$log" | tail -60 >&2
  echo "ci_cuda_torch_build: building the CUDA extension failed (log: $log)" >&2
  exit 1
fi
grep -E "^ *sbd_ext: " "$log" | sed 's/^ *//' | sort -u || true  # the toolkit and architectures the build used
echo "CUDA extension built and installed in $((SECONDS - start)) s"

# Run from outside the checkout, so that the installed package (not the source folder) is imported.
(cd "$work" && env -u PYTHONPATH "$py" "$root/tools/cuda_torch_smoke.py")
