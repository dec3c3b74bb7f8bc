#!/usr/bin/env bash
# Installs what tiermem needs to build, test and run, with apt, and only what is missing.
# Idempotent: a second run installs nothing. CUDA is optional: when nvcc is found
# (PATH or /usr/local/cuda/bin) the build compiles the CUDA sources; this script never installs it.
#
#   scripts/setup.sh            # install missing packages
#   scripts/setup.sh --check    # list what is missing, install nothing (exit 1 if anything is)
#   scripts/setup.sh --python   # also: the Python virtual environment of the Python package's
#                               # build and tests (make test-python), outside the clone
#
# The Python environment lives at ${TIERMEM_VENV:-$HOME/.cache/tiermem/venv}, is made once and
# reused by every clone on the machine (CI included): it is refreshed only when the pinned list
# below changes. torch comes from PyPI (its Linux wheel pulls CUDA runtime libraries: ~5 GiB on
# disk, downloaded once); the package itself never links torch. After this, builds and tests run
# offline (pip install --no-build-isolation --no-index).
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  liburing-dev libnuma-dev libhwloc-dev libboost-dev
  nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev libxxhash-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenmpi-dev openmpi-bin libopenblas-dev
  fio fortunes
  python3-dev python3-venv
  libaio-dev
)

# Pinned PyPI packages of the Python environment (scripts/setup.sh --python).
python_packages=(
  numpy==2.4.6 pytest==9.2.0 nanobind==3.1.0 scikit-build-core==1.1.2 ninja==1.13.2 torch==2.15.0
  transformers==5.23.0 accelerate==1.15.0 peft==0.21.2 trl==1.16.0
)
# Built from its sdist against the torch above (no build isolation: that would fetch torch again);
# only the interop test uses it (DeepSpeed's swappers driving tiermem.aio_handle).
python_packages_no_isolation=(deepspeed==0.19.8)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

want_python=0
if [[ "${1:-}" == "--python" ]]; then want_python=1; fi

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
  echo "setup: CUDA toolkit found: make build and make test compile the CUDA sources (make demo only where a GPU is visible)"
else
  echo "setup: no CUDA toolkit; building CPU-only (SimDevice)"
fi

if ((want_python)); then
  venv="${TIERMEM_VENV:-$HOME/.cache/tiermem/venv}"
  stamp="$venv/.tiermem-packages"
  want="${python_packages[*]} ${python_packages_no_isolation[*]}"
  if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]] &&
     "$venv/bin/python" -c "import numpy, pytest, nanobind, scikit_build_core, torch, deepspeed, transformers, accelerate, peft, trl" 2>/dev/null; then
    echo "setup: Python environment $venv is up to date"
  else
    echo "setup: making the Python environment $venv ($want)"
    # The system interpreter: its headers come from python3-dev above.
    [[ -x "$venv/bin/python" ]] || /usr/bin/python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "${python_packages[@]}"
    "$venv/bin/python" -m pip install -q --no-build-isolation "${python_packages_no_isolation[@]}"
    echo "$want" > "$stamp"
  fi
fi
