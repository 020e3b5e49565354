#!/usr/bin/env bash
# Lint and run the whole test suite on CPU. Extra arguments go to pytest (e.g. a test file or -k).
# Tests start local gloo process groups (and, later, Ray); as root they run in a network namespace with
# only loopback up, so nothing can listen on or reach another address.
set -euo pipefail
cd "$(dirname "$0")/.."
# pytest exits 5 when a phase selects no test (e.g. a single file was asked for): not a failure here.
phase() { python -m pytest -q -ra "$@" || { rc=$?; [ "$rc" -eq 5 ] || return "$rc"; }; }
# The time of day beside what starts, so that a CI log says where its minutes went (pytest prints each phase's).
say() { echo "[test.sh $(date -u +%H:%M:%S)] $*"; }
# A phase run in the background: wait for it, print its report (from LOG) under a heading, return its status.
report() {
  local name=$1 pid=$2 log=$3 rc=0
  wait "$pid" || rc=$?
  echo "----- $name, ended by $(date -u +%H:%M:%S) -----"
  cat "$log"
  rm -f "$log"
  return "$rc"
}

# Two pytest-xdist workers, each module on one worker (its module fixtures built once): a serial run kept
# 2 cores about 55 % busy, most tests being one process waiting on another (docs/tests.md). MARS_TEST_WORKERS
# sets another count (0: no workers, one process). vLLM sets process-wide state (threads, NUMA binding), so
# its tests get pytest processes of their own (two workers, a module each). They start when the first
# worker has finished (the file MARS_FIRST_WORKER_DONE names appears, tests/conftest.py): run beside both
# workers from the start they slowed their multi-process tests more than they saved; in one process after
# the main phase they left a core idle for its last minutes. Its report follows the main phase's.
when_a_core_frees() {  # or the shell that started the phases has gone (killed)
  while [ ! -e "$MARS_FIRST_WORKER_DONE" ] && kill -0 "$$" 2>/dev/null; do sleep 2; done
}
offline_phases() {
  export PATH="$PWD/${MARS_VENV:-.venv}/bin:$PATH"
  : "${MARS_FIRST_WORKER_DONE:=$(mktemp -u)}"
  export MARS_FIRST_WORKER_DONE
  local workers=${MARS_TEST_WORKERS:-2} vllm_log vllm rc=0 vllm_rc=0 vllm_workers
  # vLLM's modules on two workers of their own too: one process each (vLLM's process-wide state stays
  # in its module's worker), so that once the main phase ends both cores run them
  vllm_workers=$((workers > 2 ? 2 : workers))
  vllm_log=$(mktemp)
  (when_a_core_frees && say "vLLM phase" &&
    phase -n "$vllm_workers" --dist loadfile -m "vllm and not network" "$@") >"$vllm_log" 2>&1 &
  vllm=$!
  # in the foreground (a debugger's prompt works with MARS_TEST_WORKERS=0)
  phase --durations=15 -n "$workers" --dist loadfile --no-loadscope-reorder -m "not vllm and not network" "$@" ||
    rc=$?
  say "main phase ended"
  touch "$MARS_FIRST_WORKER_DONE"  # no worker may have said so (-n 0, a failure before the workers ran)
  report "vLLM phase (pytest -m vllm)" "$vllm" "$vllm_log" || vllm_rc=$?
  [ "$rc" -ne 0 ] && return "$rc"
  return "$vllm_rc"
}
if [ -n "${MARS_IN_NETNS:-}" ]; then
  offline_phases "$@"
  exit
fi

# Set-up waits on the network and the disk more than on the cores: the Slurm packages (apt-get) install
# while pip fills the virtual environments.
say "set-up: .venv, .venv-launch, Slurm's packages"
scripts/setup_slurm.sh &  # Slurm, MUNGE, MariaDB for tests/test_slurm_real.py (root: apt-get)
slurm=$!
scripts/setup.sh
wait "$slurm"
export PATH="$PWD/${MARS_VENV:-.venv}/bin:$PATH"
# The 2-core machines CI runs on change speed from hour to hour (one test took 35 s in one run and 52 s in
# another, the code unchanged): the log keeps a fixed workload's time beside the tests' so that two runs'
# minutes can be compared (docs/tests.md#ci-time). The workload: a fresh `import torch`, best of 3.
probe='import subprocess, sys, time
def once():
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t
print(f"{min(once() for _ in range(3)):.2f}")'
say "speed probe: a fresh import torch takes $(python -c "$probe") s (best of 3; docs/tests.md#ci-time)"
say "lint"
ruff check .
ruff format --check .
# Tests that need the package registry (PyPI) run outside the namespace that cuts the network off, when
# the main phase's first worker is done (they mostly wait on downloads); their report comes last.
say "tests: main phase on ${MARS_TEST_WORKERS:-2} workers; the vLLM and network phases once a core frees"
MARS_FIRST_WORKER_DONE=$(mktemp -u)  # created by the main phase's controller, seen in and out of the namespace
export MARS_FIRST_WORKER_DONE
netlog=$(mktemp)
(when_a_core_frees && say "network phase" && phase -m network "$@") >"$netlog" 2>&1 &
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
touch "$MARS_FIRST_WORKER_DONE"  # the offline phases are over, even if the namespace's shell failed first
network_rc=0
report "network phase (pytest -m network)" "$network" "$netlog" || network_rc=$?
rm -f "$MARS_FIRST_WORKER_DONE"
[ "$rc" -ne 0 ] && exit "$rc"
exit "$network_rc"
