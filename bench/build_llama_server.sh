#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` from the llama.cpp source vendored in the pinned
# llama-cpp-python sdist, so the benchmark compares against exactly the C++ code tokenmill
# runs in-process. The binary is cached in $BENCH_CACHE (default ~/.cache/tokenmill-bench,
# shared by every clone on the machine, as pip's wheel cache is); later runs skip the build.
# Prints the path of the binary on stdout (everything else goes to stderr).
set -euo pipefail

cd "$(dirname "$0")/.."
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${BENCH_CACHE:-${HOME}/.cache/tokenmill-bench}"
PY="${PYTHON:-.venv/bin/python}"
SRC="$CACHE/llama_cpp_python-$VERSION"
BUILD="$CACHE/llama-server-build-$VERSION"
BIN="$BUILD/bin/llama-server"

if [[ -x "$BIN" ]]; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$CACHE"
if [[ ! -d "$SRC/vendor/llama.cpp" ]]; then
    sdist="$(ls "$CACHE"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
    if [[ -z "$sdist" ]]; then
        echo "downloading the llama-cpp-python==$VERSION sdist" >&2
        "$PY" -m pip download -q --no-binary :all: --no-deps \
            "llama-cpp-python==$VERSION" -d "$CACHE" >&2
        sdist="$CACHE/llama_cpp_python-$VERSION.tar.gz"
    fi
    tar -xzf "$sdist" -C "$CACHE"
fi

# Same CPU flags as the llama-cpp-python build (GGML_NATIVE); no curl, no GPU backends.
# Release build: the default would be an unoptimised binary and an unfair comparison.
echo "building llama-server (several minutes on 2 cores)" >&2
GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$BUILD" --target llama-server -j "${BENCH_BUILD_JOBS:-2}" >&2
test -x "$BIN"
echo "$BIN"
