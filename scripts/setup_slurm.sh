#!/usr/bin/env bash
# Install what the real-Slurm tests (tests/test_slurm_real.py) start on this machine: Debian's Slurm
# (slurmctld, slurmd, slurmdbd and the client tools), MUNGE and MariaDB for the accounting database.
# Needs root and apt-get; elsewhere it says so and exits 0 (the tests then skip, naming what is missing;
# under CI they fail). Idempotent: nothing is installed when every tool is there.
set -euo pipefail
tools=(slurmctld slurmd slurmdbd sbatch sacct munged mungekey mariadbd mariadb-install-db)
missing=()
for tool in "${tools[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || missing+=("$tool")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "[setup-slurm] missing ${missing[*]}; install slurm-wlm slurmdbd munge mariadb-server as root" \
    "to run the real-Slurm tests" >&2
  exit 0
fi
echo "[setup-slurm] installing Slurm, MUNGE and MariaDB for the real-Slurm tests (about a minute)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
# the packages' services stay down (no init here); the tests start their own daemons
apt-get install -y -q --no-install-recommends slurm-wlm slurmdbd munge mariadb-server >/dev/null
