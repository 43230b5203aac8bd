#!/usr/bin/env bash
# Builds the benchmark's anchor: llama.cpp's own C++ server (llama-server), llama-bench and
# llama-quantize, from the llama.cpp source that the llama-cpp-python sdist vendors (pinned below),
# so that `tools/bench.py --vs-llama-cpp` runs from a clone of this repository. About 10 minutes on
# 2 cores; needs a C++ compiler (cmake comes from pip when absent).
#
#   tools/build_llama_server.sh [--isa native|avx2] [--prefix DIR] [--with-python]
#
# --prefix DIR   where bin/ lands (default: build/llama.cpp in this repository, where
#                tools/bench_http.py looks; TURBOSPARK_LLAMA_PREFIX sets it too)
# --isa native   the flags this CPU has (AVX2, FMA, F16C; AVX-512 and its VNNI, VBMI, BF16 where
#                /proc/cpuinfo lists them); the default
# --isa avx2     no AVX-512 even where the CPU has it: the side-by-side for AVX2-only CPUs, run on any
#                machine beside this package compiled for the same ISA (NUMBA_CPU_NAME=haswell or
#                znver3, with a fresh NUMBA_CACHE_DIR)
# --with-python  also llama-cpp-python's server, same version and flags, in a venv at DIR/venv (the
#                bench's third server, `--llama-python DIR/venv/bin/python`)
#
# The bench then runs it as  DIR/bin/llama-server -m MODEL.gguf -t 2 -tb 2 -c 16384 -np 8 ...
# AMX stays off: where the CPU reports AMX but the sandbox withholds the tile state, a native build
# crashes in libggml-cpu on its first batched prompt.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${TURBOSPARK_LLAMA_PREFIX:-$repo/build/llama.cpp}
ISA=native
WITH_PYTHON=0
VERSION=0.3.36
while [[ $# -gt 0 ]]; do
  case $1 in
    --isa) ISA=${2:?--isa needs native or avx2}; shift 2 ;;
    --prefix) PREFIX=${2:?--prefix needs a directory}; shift 2 ;;
    --with-python) WITH_PYTHON=1; shift ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ $ISA == native || $ISA == avx2 ]] || { echo "--isa must be native or avx2, not '$ISA'" >&2; exit 2; }
mkdir -p "$PREFIX/bin"
PREFIX=$(cd "$PREFIX" && pwd)

flags="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
if [[ $ISA == native ]] && grep -qw avx512f /proc/cpuinfo; then
  flags="$flags -DGGML_AVX512=ON"
  grep -qw avx512_vnni /proc/cpuinfo && flags="$flags -DGGML_AVX512_VNNI=ON"
  grep -qw avx512vbmi /proc/cpuinfo && flags="$flags -DGGML_AVX512_VBMI=ON"
  grep -qw avx512_bf16 /proc/cpuinfo && flags="$flags -DGGML_AVX512_BF16=ON"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work"
tar xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
src=$work/llama_cpp_python-$VERSION/vendor/llama.cpp
command -v cmake >/dev/null || python3 -m pip install -q cmake
# shellcheck disable=SC2086
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF $flags >/dev/null
cmake --build "$work/build" --target llama-server llama-bench llama-quantize -j"$(nproc)" >/dev/null
cp "$work/build/bin/llama-server" "$work/build/bin/llama-bench" "$work/build/bin/llama-quantize" "$PREFIX/bin/"
"$PREFIX/bin/llama-server" --version 2>&1 | tail -1
echo "built ($ISA): $PREFIX/bin/llama-server, llama-bench, llama-quantize (static)"

if [[ $WITH_PYTHON == 1 ]]; then
  python3 -m venv "$PREFIX/venv"
  CMAKE_ARGS="$flags" "$PREFIX/venv/bin/pip" install -q --no-binary llama-cpp-python \
    "llama-cpp-python[server]==$VERSION"
  echo "built ($ISA): $PREFIX/venv/bin/python -m llama_cpp.server"
fi
