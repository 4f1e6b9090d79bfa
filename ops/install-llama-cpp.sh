#!/usr/bin/env bash
# Install llama.cpp's Python binding (llama-cpp-python) into its own virtual environment, for the
# parity fixture (ops/llama-parity-fixture.py) and the llama.cpp rows of `scd bench model`
# (ops/llama-bench.py). Neither the build nor the tests need it; the fixture is checked in.
# Idempotent: an environment that already imports llama_cpp at the pinned version is kept.
#   SCD_LLAMA_VENV   where the environment goes (default: <repo>/.cache/llama-cpp)
#
# Built from source (7 to 10 minutes on 2 cores). llama.cpp's default native build dies with
# SIGILL on these VMs, so the build names its instruction sets itself: AVX-512 on, AMX off. pip's
# wheel cache does not key on CMAKE_ARGS, hence --no-cache-dir (a cached native wheel would be
# reused).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${SCD_LLAMA_VENV:-$repo/.cache/llama-cpp}
version=0.3.36

if "$venv/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$version')" 2>/dev/null; then
  echo "llama-cpp: llama-cpp-python $version present in $venv"
  exit 0
fi
command -v python3 >/dev/null || { echo "llama-cpp: python3 is missing" >&2; exit 1; }
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check --upgrade pip
echo "llama-cpp: building llama-cpp-python $version into $venv (7 to 10 minutes) ..."
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
  "$venv/bin/pip" install --disable-pip-version-check --no-cache-dir "llama-cpp-python==$version"
"$venv/bin/python" -c "import llama_cpp; print('llama-cpp: llama-cpp-python', llama_cpp.__version__, 'in $venv')"
