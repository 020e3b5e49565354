#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned CPU environment and the package installed editable.
# Idempotent: a stamp of the requirement files skips the install when nothing changed.
# scripts/setup_launch.sh makes (or reuses) .venv-launch, the launcher's NeMo-Run environment, meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${MARS_VENV:-.venv}
stamp="$VENV/.mars-setup-stamp"
if [ -f "$VENV/.mars-gpu-env" ]; then
  echo "[setup] $VENV holds the CUDA environment of scripts/setup_gpu.sh; the CPU suite needs its own:" \
    "MARS_VENV=.venv-cpu $0 (or run scripts/gpu_check.sh there)" >&2
  exit 1
fi
want=$(cat requirements/cpu.txt setup.cfg | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exec scripts/setup_launch.sh
fi
echo "[setup] creating $VENV with the pinned CPU environment (about 3 minutes on a fresh machine)" >&2
# .venv-launch fills beside it: both installs wait on downloads more than on the cores
scripts/setup_launch.sh &
launch=$!
trap 'wait "$launch" 2>/dev/null || true' EXIT  # an install that fails here does not leave it behind
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q pip==26.3 2>&1 | grep -v -i "warning" >&2 || true
"$VENV/bin/python" -m pip install -q -r requirements/cpu.txt 2>&1 | grep -v -i "warning" >&2 || true
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>&1 | grep -v -i "warning" >&2 || true
# under a lock: the two scripts' editable builds share this tree's mars_megatron.egg-info
flock setup.cfg "$VENV/bin/python" -m pip install -q --no-deps -e . 2>&1 | grep -v -i "warning" >&2 || true
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" -c "import torch, megatron.core, transformers, vllm, mars_megatron" \
  || { echo "[setup] environment check failed" >&2; exit 1; }
echo "$want" > "$stamp"
wait "$launch"
