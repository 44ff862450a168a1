#!/usr/bin/env bash
# CI step after the README's test command: the manual builds in strict mode (warnings and broken links fail).
# Installs the docs extra's packages into the test venv, read from pyproject.toml (installing ".[docs]" would rebuild
# the extension), redraws the plots from the committed results (bench/plots.py), then `mkdocs build --strict`.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
mkdir -p build-docs
python - > build-docs/requirements.txt <<'PY'
import tomllib

print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))
PY
pip install -q -r build-docs/requirements.txt
python bench/plots.py
python bench/render_results.py --check   # the README's and the benchmarks page's tables are what bench/results/report/ gives
python bench/render_results.py           # (and its plot, redrawn)
mkdocs build --strict
