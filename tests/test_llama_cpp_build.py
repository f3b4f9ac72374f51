"""scripts/llama_cpp.sh builds llama.cpp's host-side C++ as a unity build (scripts/llama_cpp_unity.cmake) and falls
back to the plain build when that fails. The CMake file runs under the real cmake on a small project with the same
target and file names; the script's fallback runs with a fake pip and a fake cmake. The real build is CI's setup
phase (a fresh machine compiles it; docs/peers.md)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT

UNITY = ROOT / "scripts" / "llama_cpp_unity.cmake"

# the targets and files llama_cpp_unity.cmake names, laid out as llama.cpp lays them out
PROJECT = {
    "CMakeLists.txt": "cmake_minimum_required(VERSION 3.19)\nproject(mini CXX)\n"
                      "add_subdirectory(common)\nadd_subdirectory(tools/server)\nadd_subdirectory(tools/mtmd)\n"
                      "add_subdirectory(ggml)\n",
    "common/CMakeLists.txt": "add_library(llama-common STATIC a.cpp json.cpp b.cpp)\n",
    "tools/server/CMakeLists.txt": "add_library(server-context STATIC c.cpp d.cpp)\n"
                                   "add_library(llama-server-impl STATIC e.cpp f.cpp)\n",
    "tools/mtmd/CMakeLists.txt": "add_library(mtmd STATIC clip.cpp mtmd-helper.cpp mtmd-helper-gen.cpp g.cpp)\n",
    "ggml/CMakeLists.txt": "project(ggml CXX)\nadd_library(ggml-cpu STATIC ops.cpp repack.cpp)\n",
}


def _unity_sources(build: Path) -> dict[str, set[str]]:
    """Target name -> the source file names its generated unity translation units include."""
    out: dict[str, set[str]] = {}
    for tu in build.rglob("Unity/unity_*_cxx.cxx"):
        target = tu.parent.parent.name.removesuffix(".dir")
        names = {line.rsplit("/", 1)[-1].rstrip('"') for line in tu.read_text().splitlines() if "#include" in line}
        out.setdefault(target, set()).update(names)
    return out


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed (scripts/setup.sh --all needs it)")
def test_unity_cmake_batches_the_host_side_targets_and_leaves_ggml_and_the_clashing_files_out(tmp_path):
    src = tmp_path / "src"
    for rel, text in PROJECT.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    for f in ["a", "json", "b", "c", "d", "e", "f", "clip", "mtmd-helper", "mtmd-helper-gen", "g", "ops", "repack"]:
        for d in ["common", "tools/server", "tools/mtmd", "ggml"]:
            (src / d / f"{f}.cpp").write_text("")
    build = tmp_path / "build"
    res = subprocess.run(["cmake", "-S", str(src), "-B", str(build), f"-DCMAKE_PROJECT_INCLUDE={UNITY}"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = _unity_sources(build)
    assert got == {"llama-common": {"a.cpp", "b.cpp"}, "server-context": {"c.cpp", "d.cpp"},
                   "llama-server-impl": {"e.cpp", "f.cpp"}, "mtmd": {"clip.cpp", "g.cpp"}}


FAKE_PIP = r"""#!/usr/bin/env bash
# download: an sdist with the vendored tree; wheel: a wheel file that lists the libraries packed into it
set -e
cmd=$1; shift
case $cmd in
  download) while [ "$1" != -d ]; do shift; done; d=$2
    mkdir -p "$d/llama_cpp_python-0.3.36/vendor/llama.cpp"; touch "$d/llama_cpp_python-0.3.36/.gitignore"
    tar czf "$d/llama_cpp_python-0.3.36.tar.gz" -C "$d" llama_cpp_python-0.3.36; rm -rf "$d/llama_cpp_python-0.3.36" ;;
  wheel) while [ "$1" != -w ]; do shift; done; w=$2; src=${@: -1}
    mkdir -p "$w"; ls "$src/llama_cpp/lib" > "$w/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl" ;;
esac
"""

FAKE_CMAKE = r"""#!/usr/bin/env bash
# configure: remember whether the unity include came; build: fail where FAIL says so, else make the outputs
echo "$*" >> "$CMAKE_LOG"
if [ "$1" = --build ]; then
  b=$2
  if [ -f "$b/unity" ] && [ -n "${FAIL_UNITY:-}" ]; then echo "unity_2_cxx.cxx: error: specialization after instantiation"; exit 1; fi
  if [ -n "${FAIL_ALL:-}" ]; then echo "ops.cpp: error: broken compiler"; exit 1; fi
  mkdir -p "$b/bin"; for f in libggml.so.0 libllama.so.0 libllama-server-impl.so llama-server; do echo x > "$b/bin/$f"; done
  exit 0
fi
while [ $# -gt 0 ]; do case $1 in -B) b=$2; shift ;; -DCMAKE_PROJECT_INCLUDE=*) inc=${1#*=} ;; esac; shift; done
mkdir -p "$b"; [ -z "${inc:-}" ] || { [ -f "$inc" ] && touch "$b/unity"; }
"""


def _run_script(tmp_path, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "cmake").write_text(FAKE_CMAKE)
    (bin_dir / "cmake").chmod(0o755)
    (tmp_path / "pip").write_text(FAKE_PIP)
    log = tmp_path / "cmake.log"
    log.unlink(missing_ok=True)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "llama_cpp.sh"), f"bash {tmp_path / 'pip'}",
                          str(tmp_path / "cache")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CMAKE_LOG": str(log), **env})
    configures = [line for line in log.read_text().splitlines() if not line.startswith("--build")]
    return res, configures


def test_the_script_builds_with_the_unity_include_and_packs_the_wheel(tmp_path):
    res, configures = _run_script(tmp_path)
    assert res.returncode == 0, res.stderr
    assert len(configures) == 1 and f"-DCMAKE_PROJECT_INCLUDE={UNITY}" in configures[0]
    wheel = Path(res.stdout.strip().splitlines()[-1])
    assert wheel.parent.parent == tmp_path / "cache" / "wheels" and wheel.name.startswith("llama_cpp_python-0.3.36-")
    assert {"libggml.so", "libggml.so.0", "llama-server", "libllama-server-impl.so"} <= set(wheel.read_text().split())
    assert "warning" not in res.stderr


def test_a_failed_unity_build_warns_once_and_builds_without_it(tmp_path):
    res, configures = _run_script(tmp_path, FAIL_UNITY="1")
    assert res.returncode == 0, res.stderr
    assert len(configures) == 2
    assert "CMAKE_PROJECT_INCLUDE" in configures[0] and "CMAKE_PROJECT_INCLUDE" not in configures[1]
    warnings = [line for line in res.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "the unity build failed (unity_2_cxx.cxx: error: specialization" in warnings[0]
    assert res.stdout.strip().endswith(".whl")


def test_a_build_that_fails_both_ways_fails_the_script_with_the_compiler_output(tmp_path):
    res, configures = _run_script(tmp_path, FAIL_ALL="1")
    assert res.returncode != 0 and len(configures) == 2
    assert "ops.cpp: error: broken compiler" in res.stderr
    assert not list((tmp_path / "cache").rglob("*.whl"))



# setup.sh's background build as setup starts and stops it (its own start_llama, stop_llama and EXIT trap), with a
# fake scripts/llama_cpp.sh whose "compiler" is a grandchild that would run for minutes
FAKE_BUILD = "sleep 300 &\necho $! > compiler.pid.tmp\nmv compiler.pid.tmp compiler.pid\nwait\n"


def _gone(pid: int) -> bool:
    try:  # a zombie waits for its reaper but runs no more
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("stop", ["a later step fails", "SIGTERM to setup", "Ctrl-C"])
def test_a_setup_that_stops_before_the_wait_stops_the_compile_too(tmp_path, stop):
    text = (ROOT / "scripts" / "setup.sh").read_text()
    funcs = [re.search(rf"^{name}\(\) \{{.*?^\}}$", text, re.S | re.M) for name in ("start_llama", "stop_llama")]
    assert all(funcs) and "\ntrap stop_llama EXIT\n" in text, "setup.sh: start_llama, stop_llama or the trap is gone"
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "llama_cpp.sh").write_text(FAKE_BUILD)
    (tmp_path / "venv").mkdir()
    script = "\n".join(["set -euo pipefail", "VENV=venv PIP=pip QB_CACHE=cache", 'llama_pid=""',
                        *(f.group(0) for f in funcs), "trap stop_llama EXIT", "start_llama",
                        "while [ ! -e compiler.pid ]; do sleep 0.05; done",  # the compile runs: then the next step
                        "false" if stop == "a later step fails" else "sleep 60"])
    # a session of its own: Ctrl-C signals setup's whole foreground process group, as a terminal does
    proc = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, start_new_session=True)
    pid_file, deadline = tmp_path / "compiler.pid", time.monotonic() + 30
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the fake build never started"
        time.sleep(0.05)
    compiler = int(pid_file.read_text())
    try:
        if stop != "a later step fails":
            time.sleep(0.3)  # setup is in its next step
            if stop == "Ctrl-C":
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.terminate()
        assert proc.wait(timeout=30) != 0
        deadline = time.monotonic() + 10
        while not _gone(compiler) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(compiler), f"the compile ({compiler}) outlived setup ({stop})"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(compiler, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
