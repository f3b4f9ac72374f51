#!/usr/bin/env bash
# llama.cpp for this CPU, built once for both of its uses here: engine=llama_cpp (the llama-cpp-python 0.3.36
# binding) and llama-server (the serving load's HTTP target, harness/load/server.py). Usage:
#   scripts/llama_cpp.sh PIP CACHE_DIR     (PIP: the venv's "python -m pip"; prints the wheel's path)
#
# Why one build: llama-cpp-python's own sdist build compiles ggml, llama, common and mtmd as shared libraries,
# and a static llama-server compiled all of them again: 5.5 + 6.2 min on a fresh 2-core Zen 4 machine, 12 of the
# 15.5 minutes of `setup.sh --all`. Here one CMake build of the llama.cpp that the sdist vendors compiles the
# shared libraries and the server together (4.5 min on 2 idle Zen 4 cores, 3.4 min with the host-side C++ as the
# unity build of scripts/llama_cpp_unity.cmake), and the binding's Python files, those libraries and the
# server are packed into one wheel (the binding is built with LLAMA_BUILD=OFF: Python only). The server's RUNPATH
# is $ORIGIN: it runs from llama_cpp/lib beside the libraries the binding loads (setup.sh links it into .venv/bin).
#
# GGML_NATIVE=ON tunes the code to this CPU, so the wheel is cached under a key of the CPU's model and flags:
# a natively tuned wheel reused on another CPU would die of an illegal instruction, and pip's own cache does not
# know the CPU. The compile flags are the sdist build's own (checked 2026-12-06: identical -O3/-march lines for
# ggml-cpu and llama); the libraries are stripped, as scikit-build-core's install strips them.
set -euo pipefail
PIP=$1 CACHE=$2
VERSION=0.3.36
cpu_key=$( (grep -m1 '^model name' /proc/cpuinfo; grep -m1 '^flags' /proc/cpuinfo; uname -m) 2>/dev/null | sha256sum | cut -c1-12)
# "llama-cpp-1-": the wheel with the server inside (the older llama-cpp-<key> wheels had no server)
dest="$CACHE/wheels/llama-cpp-1-$cpu_key"
if ls "$dest"/llama_cpp_python-$VERSION-*.whl >/dev/null 2>&1; then ls "$dest"/llama_cpp_python-$VERSION-*.whl; exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$PIP download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VERSION" >&2
tar xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$tmp"
src="$tmp/llama_cpp_python-$VERSION"
gen=(); command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
build() {  # build EXTRA_CMAKE_ARGS...: configure and build the libraries and the server into $tmp/build
  rm -rf "$tmp/build"
  cmake -S "$src/vendor/llama.cpp" -B "$tmp/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF "$@" >"$tmp/build.log" 2>&1 &&
    cmake --build "$tmp/build" --target llama-server llama ggml mtmd -j "$(nproc)" >>"$tmp/build.log" 2>&1
}
# the host-side C++ as a unity build (scripts/llama_cpp_unity.cmake says why and what); where that fails, the plain
# build, after one warning line
if ! build "-DCMAKE_PROJECT_INCLUDE=$(cd "$(dirname "$0")" && pwd)/llama_cpp_unity.cmake"; then
  echo "llama_cpp.sh: warning: the unity build failed ($(grep -m1 -E 'error|Error' "$tmp/build.log" | cut -c1-160)); building without it" >&2
  build || { tail -20 "$tmp/build.log" >&2; exit 1; }
fi
lib="$src/llama_cpp/lib"
mkdir -p "$lib"
# the binding opens libX.so by that name; the libraries name each other by soname (libX.so.0): a wheel holds no
# symbolic links, so both names are copies (as in the sdist's own wheel)
for f in "$tmp"/build/bin/lib*.so.0; do cp -L "$f" "$lib/"; cp -L "$f" "$lib/$(basename "${f%.0}")"; done
cp -L "$tmp/build/bin/libllama-server-impl.so" "$tmp/build/bin/llama-server" "$lib/"
strip --strip-unneeded "$lib"/* 2>/dev/null || true
rm -f "$src/.gitignore"  # it ignores lib/ and *.so, which scikit-build-core then leaves out of the wheel
mkdir -p "$dest"
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $PIP wheel -q --no-deps -w "$tmp/wheel" "$src" >&2
mv "$tmp"/wheel/llama_cpp_python-$VERSION-*.whl "$dest/"
ls "$dest"/llama_cpp_python-$VERSION-*.whl
