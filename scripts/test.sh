#!/usr/bin/env bash
# Lint and run the whole test suite on CPU. Tests start local gloo process groups (and, later, Ray);
# when possible they run in a network namespace with only loopback up, so nothing listens outside.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/${MARS_VENV:-.venv}/bin:$PATH"
ruff check .
ruff format --check .
cmd=(python -m pytest -q -ra --durations=15 "$@")
if [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then
  exec unshare -n sh -c 'ip link set lo up && exec "$@"' sh "${cmd[@]}"
fi
exec "${cmd[@]}"
