#!/usr/bin/env bash
# Lint and run the whole test suite on CPU. Extra arguments go to pytest (e.g. a test file or -k).
# Tests start local gloo process groups (and, later, Ray); as root they run in a network namespace with
# only loopback up, so nothing can listen on or reach another address.
set -euo pipefail
cd "$(dirname "$0")/.."
# pytest exits 5 when a phase selects no test (e.g. a single file was asked for): not a failure here.
phase() { python -m pytest -q -ra "$@" || { rc=$?; [ "$rc" -eq 5 ] || return "$rc"; }; }

# Two pytest-xdist workers, each module on one worker (its module fixtures built once): a serial run kept
# 2 cores about 55 % busy, most tests being one process waiting on another (docs/tests.md). MARS_TEST_WORKERS
# sets another count (0: no workers, one process). vLLM sets process-wide state (threads, NUMA binding), so
# its tests get a pytest process of their own, run beside the workers: alone it kept the cores about 56 %
# busy, and beside them it fills the time one worker waits for the other at the end. Its report follows.
offline_phases() {
  export PATH="$PWD/${MARS_VENV:-.venv}/bin:$PATH"
  local workers=${MARS_TEST_WORKERS:-2} vllm_log vllm rc=0 vllm_rc=0
  vllm_log=$(mktemp)
  phase -m "vllm and not network" "$@" >"$vllm_log" 2>&1 &
  vllm=$!
  phase --durations=15 -n "$workers" --dist loadfile --no-loadscope-reorder -m "not vllm and not network" "$@" ||
    rc=$?
  wait "$vllm" || vllm_rc=$?
  echo "----- vLLM phase (pytest -m vllm) -----"
  cat "$vllm_log"
  rm -f "$vllm_log"
  [ "$rc" -ne 0 ] && return "$rc"
  return "$vllm_rc"
}
if [ -n "${MARS_IN_NETNS:-}" ]; then
  offline_phases "$@"
  exit
fi

# Set-up waits on the network and the disk more than on the cores: the Slurm packages (apt-get) install
# while pip fills the virtual environments.
scripts/setup_slurm.sh &  # Slurm, MUNGE, MariaDB for tests/test_slurm_real.py (root: apt-get)
slurm=$!
scripts/setup.sh
wait "$slurm"
export PATH="$PWD/${MARS_VENV:-.venv}/bin:$PATH"
ruff check .
ruff format --check .
# Tests that need the package registry (PyPI) run outside the namespace that cuts the network off, beside
# the offline phases (they mostly wait on downloads); their report follows the offline phases' own.
netlog=$(mktemp)
phase -m network "$@" >"$netlog" 2>&1 &
network=$!
rc=0
if [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then
  # 127.0.0.2 besides 127.0.0.1: glibc's getaddrinfo(AI_ADDRCONFIG), which Slurm uses, answers IPv4
  # only when an address other than 127.0.0.1 is configured (tests/slurm_cluster.py)
  unshare -n env MARS_IN_NETNS=1 bash -c \
    'ip link set lo up && ip addr add 127.0.0.2/8 dev lo && exec bash "$0" "$@"' "$0" "$@" || rc=$?
else
  offline_phases "$@" || rc=$?
fi
network_rc=0
wait "$network" || network_rc=$?
echo "----- network phase (pytest -m network) -----"
cat "$netlog"
rm -f "$netlog"
[ "$rc" -ne 0 ] && exit "$rc"
exit "$network_rc"
