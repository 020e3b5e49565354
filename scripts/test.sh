#!/usr/bin/env bash
# Lint and run the whole test suite on CPU. Extra arguments go to pytest (e.g. a test file or -k).
# Tests start local gloo process groups (and, later, Ray); as root they run in a network namespace with
# only loopback up, so nothing can listen on or reach another address.
set -euo pipefail
cd "$(dirname "$0")/.."
# pytest exits 5 when a phase selects no test (e.g. a single file was asked for): not a failure here.
phase() { python -m pytest -q -ra "$@" || { rc=$?; [ "$rc" -eq 5 ] || return "$rc"; }; }
if [ -z "${MARS_IN_NETNS:-}" ]; then
  scripts/setup.sh
  scripts/setup_slurm.sh  # Slurm, MUNGE, MariaDB for tests/test_slurm_real.py (root: apt-get)
  export PATH="$PWD/${MARS_VENV:-.venv}/bin:$PATH"
  ruff check .
  ruff format --check .
  # Tests that need the package registry (PyPI) run here, before the namespace cuts the network off.
  phase -m network "$@"
  if [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then
    # 127.0.0.2 besides 127.0.0.1: glibc's getaddrinfo(AI_ADDRCONFIG), which Slurm uses, answers IPv4
    # only when an address other than 127.0.0.1 is configured (tests/slurm_cluster.py)
    exec unshare -n env MARS_IN_NETNS=1 bash -c \
      'ip link set lo up && ip addr add 127.0.0.2/8 dev lo && exec bash "$0" "$@"' "$0" "$@"
  fi
fi
export PATH="$PWD/${MARS_VENV:-.venv}/bin:$PATH"

# Two pytest-xdist workers, each module on one worker (its module fixtures built once): a serial run kept
# 2 cores about 55 % busy, most tests being one process waiting on another (docs/tests.md). MARS_TEST_WORKERS
# sets another count (0: no workers, one process). vLLM sets process-wide state (threads, NUMA binding), so
# its tests get a pytest process of their own.
workers=${MARS_TEST_WORKERS:-2}
phase --durations=15 -n "$workers" --dist loadfile --no-loadscope-reorder -m "not vllm and not network" "$@"
phase -m "vllm and not network" "$@"
