#!/usr/bin/env bash
# Compile check of the CUDA kernels on a machine without a GPU (CI): every csrc/cuda/*_launch.cu (kernels and
# launchers, no torch headers) is compiled with nvcc for the architectures of tools/build_config.json (sm_80 and
# sm_90a), with its flags (the same as setup.py's and CMake's). Warnings are errors; ptxas reports register spills.
# Exits non-zero if any file fails.
#
#   bash csrc/cuda/compile_check.sh              # the launch files (what CI runs)
#   bash csrc/cuda/compile_check.sh --bindings   # also the torch-facing *_cuda.cpp bindings (host C++, passed
#                                                # by nvcc to the host compiler) against the installed torch's
#                                                # headers (a CPU wheel has the c10/cuda headers they use)
# Environment: NVCC (default nvcc), JOBS (parallel compiles, default 2), PYTHON (reads the config; default python3),
# SBD_EXT_CUDA_ARCH (architectures instead of the config's, TORCH_CUDA_ARCH_LIST syntax, e.g. "9.0a").
set -u
cd "$(dirname "$0")/../.."

NVCC=${NVCC:-nvcc}
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-python3}
BINDINGS=0
for arg in "$@"; do
  case "$arg" in
    --bindings) BINDINGS=1 ;;
    *) echo "usage: $0 [--bindings]" >&2; exit 2 ;;
  esac
done

if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "compile_check: nvcc not found (set NVCC)" >&2
  exit 1
fi
OUT=$(mktemp -d "${TMPDIR:-/tmp}/sbd_cuda_check.XXXXXX")
trap 'rm -rf "$OUT"' EXIT

# Flags and architectures from tools/build_config.json, one word per line, read into arrays.
config() {
  "$PYTHON" -c '
import json, os, sys
c = json.load(open("tools/build_config.json"))
what, words = sys.argv[1], []
if what == "common":
    words = ["-std=" + c["cuda_std"], "-Icsrc/include", "-Icsrc", *c["nvcc_flags"], *c["nvcc_check_flags"]]
    words += [f"-D{d}" for d in c["nvcc_defines"]]
elif what == "bind":
    words = [*c["nvcc_flags"], *(f"-D{d}" for d in c["nvcc_defines"])]
else:  # gencode: -gencode arch=compute_90a,code=sm_90a per architecture
    for a in (os.environ.get("SBD_EXT_CUDA_ARCH") or ";".join(c["cuda_archs"])).replace(" ", ";").split(";"):
        if a:
            n = a.replace(".", "").replace("+PTX", "")
            words += ["-gencode", f"arch=compute_{n},code=sm_{n}"]
print("\n".join(words))
' "$1"
}
mapfile -t COMMON < <(config common)
mapfile -t ARCHS < <(config gencode)
mapfile -t BIND_FLAGS < <(config bind)
if [ "${#COMMON[@]}" = 0 ] || [ "${#ARCHS[@]}" = 0 ]; then
  echo "compile_check: cannot read tools/build_config.json with $PYTHON" >&2
  exit 1
fi
ARCH_NAMES=$(printf '%s\n' "${ARCHS[@]}" | sed -n 's/.*code=//p' | paste -sd, -)

echo "compile_check: $("$NVCC" --version | tail -n 2 | head -n 1)"

declare -a names=() cmds=()
for src in csrc/cuda/*_launch.cu; do
  names+=("$src [$ARCH_NAMES]")
  cmds+=("$NVCC ${COMMON[*]} ${ARCHS[*]} -c $src -o $OUT/$(basename "$src" .cu).o")
done

if [ "$BINDINGS" = 1 ]; then
  TORCH_INC=$("$PYTHON" -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths()))") || {
    echo "compile_check: --bindings needs torch importable by $PYTHON" >&2
    exit 1
  }
  PY_INC=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
  ABI=$("$PYTHON" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
  # C10_CUDA_NO_CMAKE_CONFIGURE_FILE: a CPU wheel lacks c10/cuda/impl/cuda_cmake_macros.h (it only sets export
  # macros). Host code only (no kernels in these files).
  BIND=(-std=c++20 -Icsrc/include -Icsrc $TORCH_INC -I"$PY_INC" "${BIND_FLAGS[@]}" -O0
        -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE -DSBD_EXT_WITH_CUDA -D_GLIBCXX_USE_CXX11_ABI="$ABI"
        -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -arch=sm_80)
  for src in csrc/cuda/*_cuda.cpp; do
    names+=("$src [binding, host]")
    cmds+=("$NVCC ${BIND[*]} -c $src -o $OUT/$(basename "$src" .cpp).o")
  done
fi

# Run up to $JOBS compiles at once; each writes its log and its status.
start_all=$SECONDS
running=0
for idx in "${!cmds[@]}"; do
  (
    t0=$SECONDS
    if eval "${cmds[$idx]}" >"$OUT/$idx.log" 2>&1; then echo 0 >"$OUT/$idx.rc"; else echo 1 >"$OUT/$idx.rc"; fi
    echo $((SECONDS - t0)) >"$OUT/$idx.time"
  ) &
  running=$((running + 1))
  if [ "$running" -ge "$JOBS" ]; then
    wait -n
    running=$((running - 1))
  fi
done
wait

failed=0
for idx in "${!cmds[@]}"; do
  rc=$(cat "$OUT/$idx.rc" 2>/dev/null || echo 1)
  t=$(cat "$OUT/$idx.time" 2>/dev/null || echo "?")
  if [ "$rc" = 0 ]; then
    echo "  ok    ${names[$idx]}  (${t}s)"
    # ptxas spill warnings do not fail the build but should be seen.
    grep -i "spill" "$OUT/$idx.log" | sed 's/^/        /' || true
  else
    echo "  FAIL  ${names[$idx]}  (${t}s)"
    echo "        ${cmds[$idx]}"
    sed 's/^/        /' "$OUT/$idx.log"
    failed=$((failed + 1))
  fi
done
echo "compile_check: ${#cmds[@]} files, $failed failed, $((SECONDS - start_all))s"
[ "$failed" = 0 ]
