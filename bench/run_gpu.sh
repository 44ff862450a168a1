#!/usr/bin/env bash
# One command for a GPU machine with a CUDA build of torch, nvcc and no network: builds sbd_ext in place with its
# CUDA kernels, runs the test suite and the GPU benchmarks, and writes everything into one folder.
#
#   bash bench/run_gpu.sh [OUT_DIR]        # default: bench/results/<date>-<gpu>
#
# The folder gets: env.log (GPU, driver, versions), build.log, compile_check.log, tests.log + tests.xml,
# bench.log + bench_cuda_ops.json (pytest-benchmark) + cuda_ops.csv (one row per measurement), and summary.md
# (GPU, torch / CUDA versions, git commit, step results, test counts, the benchmark table against the targets).
# A failing step is recorded and the next one still runs, so partial results are always saved; the exit status
# is non-zero if any step failed.
# Environment: PYTHON (default python), MAX_JOBS (default 16), PYTEST_ARGS (extra arguments for the test run),
# BENCH_FILES (default bench/bench_cuda_ops.py).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr -c 'A-Za-z0-9.\n-' '_')
OUT=${1:-bench/results/$(date +%Y%m%d-%H%M%S)-${gpu:-unknown-gpu}}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
echo "run_gpu: writing to $OUT"
: >"$OUT/steps.tsv"

step() {  # step NAME CMD... : runs CMD with its output in NAME.log, records the status, never stops the script
  local name=$1
  shift
  local t0=$SECONDS
  echo "== $name"
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$OUT/steps.tsv"
  echo "   rc=$rc ($((SECONDS - t0))s), log: $OUT/$name.log"
}

step env bash -c "nvidia-smi; nvcc --version; git log -1 --oneline; git status --short; $PY - <<'EOF'
import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print('device', p.name, 'sm', f'{p.major}.{p.minor}', 'SMs', p.multi_processor_count, 'memory', p.total_memory)
EOF"
step build env SBD_EXT_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace
step compile_check bash csrc/cuda/compile_check.sh
# shellcheck disable=SC2086
step tests "$PY" -m pytest python_tests -rA --junitxml="$OUT/tests.xml" ${PYTEST_ARGS:-}
# shellcheck disable=SC2086
step bench env SBD_BENCH_OUT="$OUT" "$PY" -m pytest ${BENCH_FILES:-bench/bench_cuda_ops.py} -q \
  --benchmark-json="$OUT/bench_cuda_ops.json"

"$PY" - "$OUT" <<'EOF' || echo "run_gpu: could not write summary.md"
import csv, os, subprocess, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
lines = ["# sbd_ext GPU run", ""]
def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""
try:
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU visible"
    lines += [f"- GPU: {gpu}", f"- torch {torch.__version__}, CUDA {torch.version.cuda}"]
except Exception as e:  # noqa: BLE001
    lines.append(f"- torch not importable: {e}")
lines += [f"- driver: {sh('nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1')}",
          f"- nvcc: {sh('nvcc --version | tail -n 2 | head -n 1')}",
          f"- git: {sh('git rev-parse HEAD')} {'(dirty)' if sh('git status --porcelain') else ''}",
          f"- command: bash bench/run_gpu.sh {out}", "", "## Steps", "", "| step | exit | seconds |", "|---|---|---|"]
with open(os.path.join(out, "steps.tsv")) as f:
    for row in f:
        name, rc, secs = row.rstrip("\n").split("\t")
        lines.append(f"| {name} | {'ok' if rc == '0' else 'FAILED (' + rc + ')'} | {secs} |")
junit = os.path.join(out, "tests.xml")
if os.path.exists(junit):
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    tot = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    lines += ["", "## Tests", "", f"{tot['tests']} tests: {tot['failures']} failed, {tot['errors']} errors, "
              f"{tot['skipped']} skipped."]
    for s in suites:
        for case in s.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                lines.append(f"- FAILED {case.get('classname')}::{case.get('name')}")
path = os.path.join(out, "cuda_ops.csv")
if os.path.exists(path):
    rows = list(csv.DictReader(open(path)))
    lines += ["", "## Benchmarks (CUDA events, L2 flushed, median)", "",
              "Targets: entropy_sample 16x128256 < 10 us; block_attention x_roofline <= 1.3 for caches >= 4k "
              "(time / time to read the K/V cache once at peak); mask_replace < 5 us.", "",
              "| op | shape | impl | us | GB/s | % peak | x roofline |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['shape']} | {r['impl']} | {r['gpu_us']} | {r['gb_per_s']} | "
                     f"{r['pct_peak']} | {r['x_roofline']} |")
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF

failed=$(awk -F'\t' '$2 != 0' "$OUT/steps.tsv" | wc -l)
echo "run_gpu: $failed step(s) failed; results in $OUT"
[ "$failed" = 0 ]
