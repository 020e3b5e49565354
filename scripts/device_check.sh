#!/usr/bin/env bash
# The GPU check that fits the bare GPU machine (Python 3.12, torch, transformers; no Ray, vLLM, Transformer
# Engine, megatron-core or network): installs the wheels of .whl/ (scripts/device_wheels.sh, carried with
# the working tree) into a folder of its own, checks that CUDA works, then runs python -m tools.device_check:
# one table of assertions on values, written with a JSON of every figure to --out (default $OUT).
#
#   scripts/device_check.sh [--only NAME[,NAME]] [--out DIR]     # on the GPU machine
#   scripts/device_check.sh --cpu [--only ...] [--out DIR]       # CI: gloo, fp32, tiny shapes, in .venv
#
# Environment: MARS_WHEEL_DIR (default .whl), MARS_DEVICE_SITE (where the wheels are installed, default
# /tmp/mars-device-site), PYTHON (default python3: the image's), MARS_VENV (--cpu; default .venv).
# Exit status: 0 every row passed, 1 a row failed, 2 the check could not start.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
cpu=0
for arg in "$@"; do
  if [ "$arg" = "--cpu" ]; then cpu=1; fi
done
if [ "$cpu" = 1 ]; then
  VENV=${MARS_VENV:-.venv}
  if [ ! -x "$VENV/bin/python" ]; then
    echo "device_check: --cpu runs in the project's environment, but $VENV/bin/python is missing" \
      "(make it with scripts/setup.sh)" >&2
    exit 2
  fi
  exec "$VENV/bin/python" -m tools.device_check "$@"
fi

WHEELS=${MARS_WHEEL_DIR:-.whl}
SITE=${MARS_DEVICE_SITE:-/tmp/mars-device-site}
PY=${PYTHON:-python3}
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
if [ "${#wheels[@]}" -eq 0 ]; then
  echo "device_check: no wheels in $WHEELS/. Run scripts/device_wheels.sh where PyPI is reachable and carry" \
    "$WHEELS with the working tree (it is ignored by git: name it among the folders that travel)" >&2
  exit 2
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  echo "device_check: the wheels in $WHEELS are for CPython 3.12 (requirements/device.txt); $PY is" \
    "$("$PY" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo 'not runnable')" >&2
  exit 2
fi
if "$PY" -m pip --version >/dev/null 2>&1; then
  # --upgrade: a rerun on the same machine replaces what an earlier run installed
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
    --no-compile --upgrade --target "$SITE" "${wheels[@]}"
else
  # a wheel is a zip of the files pip would put in --target (these have no .data folder nor scripts)
  echo "device_check: $PY has no pip; unpacking the wheels into $SITE" >&2
  mkdir -p -- "$SITE"
  for wheel in "${wheels[@]}"; do
    "$PY" -m zipfile -e "$wheel" "$SITE"
  done
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" - <<'EOF'
import sys

try:
    import torch

    torch.ones(1, device="cuda").add_(1)
    torch.cuda.synchronize()
except Exception as e:
    version = getattr(sys.modules.get("torch"), "__version__", "not importable")
    cuda = getattr(getattr(sys.modules.get("torch"), "version", None), "cuda", None)
    print(
        f"device_check: CUDA is not usable: {type(e).__name__}: {e}\n"
        f"torch {version} is built for CUDA {cuda}; PyPI's CUDA 13 torch needs an NVIDIA driver R580 or "
        "newer (nvidia-smi shows the driver version). Without a GPU, scripts/device_check.sh --cpu runs "
        "the CI mode.",
        file=sys.stderr,
    )
    sys.exit(1)
EOF
then
  exit 2
fi
exec "$PY" -m tools.device_check "$@"
