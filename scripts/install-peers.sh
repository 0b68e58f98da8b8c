#!/usr/bin/env bash
# Install the peer routers used by `poolkeeper bench live`, each in its own virtual environment
# under .peers/ (git-ignored), pinned to the versions the benchmarks were written against
# (reference: /work/shared/reference/peers.md section 6).
#
#   scripts/install-peers.sh            # both peers
#   scripts/install-peers.sh vllm       # only vllm-router
#   scripts/install-peers.sh sglang     # only sglang-router
#
# PYTHON selects the interpreter (default python3). Re-running is cheap: an environment whose
# pinned package is already installed is left alone.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PEERS="${ROOT}/.peers"
PYTHON="${PYTHON:-python3}"
VLLM_ROUTER_VERSION="0.1.17"
SGLANG_ROUTER_VERSION="0.3.2"

install_one() {
  local name="$1" package="$2" version="$3" entry="$4"
  local venv="${PEERS}/venv-${name}"
  if [[ -x "${venv}/bin/${entry}" ]] \
    && "${venv}/bin/python" -m pip show "${package}" 2>/dev/null | grep -qx "Version: ${version}"; then
    echo "${package}==${version} already in ${venv}"
    return 0
  fi
  echo "installing ${package}==${version} into ${venv}"
  "${PYTHON}" -m venv "${venv}"
  "${venv}/bin/python" -m pip install --quiet --disable-pip-version-check "${package}==${version}"
  "${venv}/bin/python" -m pip show "${package}" | grep -x "Version: ${version}"
  test -x "${venv}/bin/${entry}"
}

mkdir -p "${PEERS}"
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  targets=(vllm sglang)
fi
for target in "${targets[@]}"; do
  case "${target}" in
    vllm) install_one vllm-router vllm-router "${VLLM_ROUTER_VERSION}" vllm-router ;;
    sglang) install_one sglang-router sglang-router "${SGLANG_ROUTER_VERSION}" smg ;;
    *) echo "unknown peer '${target}' (expected: vllm, sglang)" >&2; exit 2 ;;
  esac
done
echo "peers ready under ${PEERS}"
