#!/usr/bin/env bash
# Lint and run the whole test suite on CPU. Tests start local gloo process groups (and, later, Ray);
# when possible they run in a network namespace with only loopback up, so nothing listens outside.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/${MARS_VENV:-.venv}/bin:$PATH"
ruff check .
ruff format --check .
# vLLM sets process-wide state (threads, NUMA binding), so its tests get a pytest process of their own.
run_tests='python -m pytest -q -ra --durations=15 -m "not vllm" "$@" && python -m pytest -q -ra -m vllm "$@"'
if [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then
  exec unshare -n sh -c "ip link set lo up && $run_tests" sh "$@"
fi
exec sh -c "$run_tests" sh "$@"
