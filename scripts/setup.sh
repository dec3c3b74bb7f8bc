#!/usr/bin/env bash
# Installs what tiermem needs to build, test and run, with apt, and only what is missing.
# Idempotent: a second run installs nothing. CUDA is optional: when nvcc is found
# (PATH or /usr/local/cuda/bin) the build compiles the CUDA sources; this script never installs it.
#
#   scripts/setup.sh            # install missing packages
#   scripts/setup.sh --check    # list what is missing, install nothing (exit 1 if anything is)
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  liburing-dev libnuma-dev libhwloc-dev libboost-dev
  nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev libxxhash-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenmpi-dev openmpi-bin libopenblas-dev
  fio fortunes
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [[ "${1:-}" == "--check" ]]; then
  if ((${#missing[@]})); then echo "missing: ${missing[*]}"; exit 1; fi
  echo "all dependencies present"; exit 0
fi

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all dependencies present"
fi

if command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  echo "setup: CUDA toolkit found; the build will compile the CUDA sources"
else
  echo "setup: no CUDA toolkit; building CPU-only (SimDevice)"
fi
