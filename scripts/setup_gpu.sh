#!/usr/bin/env bash
# Create (or reuse) the CUDA environment: requirements/gpu.txt from PyPI, Transformer Engine's PyTorch binding
# (transformer-engine-torch, version in the last line of requirements/gpu.txt) built from source, then the
# package installed editable without dependencies. For GPU nodes and docker/Dockerfile. It needs no GPU, but
# it needs Python 3.11 with its headers, a C++ compiler, CUDA 13's nvcc and headers (CUDA_HOME, else nvcc on
# PATH, else /usr/local/cuda) and cudnn.h (the toolkit's, the system's or the nvidia-cudnn-cu13 wheel's).
# These are checked before anything is installed. Running it (not building it) needs an NVIDIA driver R580
# or newer: PyPI's torch 2.13 is built for CUDA 13 (an older driver leaves torch without the GPU); checked
# when nvidia-smi is there.
# cuDNN: torch loads the nvidia-cudnn-cu13 wheel's libcudnn, while Transformer Engine looks in CUDNN_HOME,
# CUDNN_PATH, CUDA_HOME, /usr/local/cuda and the system's library path before Python packages, so a node
# with its own cuDNN would get two in one process. The build uses the wheel's (CUDNN_HOME/CUDNN_PATH), and
# the venv sets CUDNN_HOME to it for every process it runs (site-packages/mars_cudnn_home.pth; the
# container sets the same in docker/Dockerfile); the final check fails if two cuDNNs are loaded.
# Idempotent: a stamp of the requirement files skips everything when nothing changed.
# Environment: PYTHON (python3), MARS_VENV (.venv), MARS_PIP_INDEX_URL (a PyPI mirror; otherwise pypi.org:
# pip's configuration files, find-links, extra indexes and constraints are ignored so that no local CPU torch
# wheel is picked up), MAX_JOBS / NVTE_BUILD_MAX_JOBS (parallel compile jobs of the binding), CXX (c++).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${MARS_VENV:-.venv}
REQS=requirements/gpu.txt
log() { echo "[setup-gpu] $*" >&2; }
die() {
  log "error: $*"
  exit 1
}

stamp="$VENV/.mars-setup-gpu-stamp"
want=$(cat "$REQS" setup.cfg | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  log "$VENV is up to date ($stamp matches $REQS and setup.cfg)"
  exit 0
fi
[ -f "$VENV/.mars-setup-stamp" ] &&
  die "$VENV holds the CPU environment of scripts/setup.sh; set MARS_VENV to another directory"

# The binding's version is written once, as the comment line '# transformer-engine-torch==X.Y.Z' in $REQS.
te_torch=$(sed -n 's/^# *\(transformer-engine-torch==[0-9][^ ]*\) *$/\1/p' "$REQS")
[ -n "$te_torch" ] || die "$REQS has no '# transformer-engine-torch==VERSION' line"

# --- driver (running needs it, building does not) ------------------------------------------------------
MIN_DRIVER=580
driver=""
if command -v nvidia-smi >/dev/null; then
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)
fi
driver_old() { [ -n "$driver" ] && [ "${driver%%.*}" -lt "$MIN_DRIVER" ] 2>/dev/null; }
driver_msg="torch 2.13 from PyPI is built for CUDA 13 and needs an NVIDIA driver R$MIN_DRIVER or newer; this node has ${driver:-none}"
if driver_old; then
  log "warning: $driver_msg: the environment builds, but torch will not see this node's GPUs until the driver is upgraded"
fi

# --- toolchain, checked before anything is installed ---------------------------------------------------
log "checking the build toolchain for $te_torch"
py="$PYTHON"
[ -x "$VENV/bin/python" ] && py="$VENV/bin/python"
"$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null ||
  die "$py is not Python 3.11 (megatron-core 0.16.1 needs it): set PYTHON, e.g. PYTHON=python3.11"
"$py" -c 'import os, sysconfig, sys; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' ||
  die "Python.h of $py not found: install the Python 3.11 headers (e.g. python3.11-dev)"
cxx=${CXX:-c++}
command -v "$cxx" >/dev/null || die "no C++ compiler ($cxx): install g++ (build-essential) or set CXX"

# nvcc: CUDA_HOME when set (and then only there), else nvcc on PATH, else /usr/local/cuda.
cuda_ok() { [ -x "$1/bin/nvcc" ] && [ -f "$1/include/cuda_runtime.h" ]; }
if [ -n "${CUDA_HOME:-}" ]; then
  cuda_ok "$CUDA_HOME" ||
    die "CUDA_HOME=$CUDA_HOME has no bin/nvcc with include/cuda_runtime.h: point CUDA_HOME at a CUDA 13 toolkit"
else
  candidates=()
  if nvcc_on_path=$(command -v nvcc); then
    candidates+=("$(dirname "$(dirname "$(readlink -f "$nvcc_on_path")")")")
  fi
  candidates+=(/usr/local/cuda)
  for home in "${candidates[@]}"; do
    if cuda_ok "$home"; then
      CUDA_HOME=$home
      break
    fi
  done
  [ -n "${CUDA_HOME:-}" ] ||
    die "nvcc not found: set CUDA_HOME to a CUDA 13 toolkit (CUDA_HOME/bin/nvcc and CUDA_HOME/include), or use a CUDA devel image"
fi
export CUDA_HOME
cuda_release=$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9][0-9]*\)\..*/\1/p')
[ "$cuda_release" = 13 ] ||
  die "CUDA_HOME=$CUDA_HOME has nvcc of CUDA ${cuda_release:-?}; the torch of $REQS is built for CUDA 13"
log "CUDA_HOME=$CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*\(release [^,]*\).*/\1/p')), C++ compiler $(command -v "$cxx")"
sys_cudnn=""
for dir in "$CUDA_HOME/include" /usr/include "/usr/include/$(uname -m)-linux-gnu"; do
  if [ -f "$dir/cudnn.h" ]; then
    sys_cudnn="$dir/cudnn.h"
    break
  fi
done
log "cudnn.h: ${sys_cudnn:-not in CUDA_HOME/include or /usr/include; expecting the one of the nvidia-cudnn-cu13 wheel}"

# --- install ------------------------------------------------------------------------------------------
# pip sees PyPI (or MARS_PIP_INDEX_URL) only: no config files, find-links, extra indexes or constraints.
pip_pypi() {
  env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT -u PIP_NO_INDEX \
    PIP_CONFIG_FILE=/dev/null ${MARS_PIP_INDEX_URL:+"PIP_INDEX_URL=$MARS_PIP_INDEX_URL"} \
    "$VENV/bin/python" -m pip "$@" >&2
}
log "creating $VENV from ${MARS_PIP_INDEX_URL:-PyPI} (about 9 GB of CUDA wheels on a fresh machine)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
touch "$VENV/.mars-gpu-env" # marks this venv as the CUDA one, from the first install on
pip_pypi install -q --upgrade pip
log "installing $REQS"
pip_pypi install -q --only-binary=:all: -r "$REQS"
"$VENV/bin/python" -c 'import sys, torch; sys.exit(not (torch.version.cuda or "").startswith("13."))' ||
  die "$VENV's torch is not the CUDA 13 build: $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"

# The include dirs of the nvidia-* wheels torch runs with (nvidia-cudnn-cu13's cudnn.h first) go on CPATH,
# which the compiler searches after the -I directories (CUDA_HOME/include) and before the system's: they
# fill what a partial toolkit lacks, and cudnn.h matches the cuDNN that torch loads.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
wheel_cudnn="$site/nvidia/cudnn/include"
[ -f "$wheel_cudnn/cudnn.h" ] || [ -n "$sys_cudnn" ] ||
  die "cudnn.h not found in CUDA_HOME/include ($CUDA_HOME/include), /usr/include or $wheel_cudnn: install cuDNN 9 headers (a cudnn devel image) or the nvidia-cudnn-cu13 wheel"
wheel_incs=""
for dir in "$wheel_cudnn" "$site"/nvidia/*/include; do
  if [ -d "$dir" ] && [[ ":$wheel_incs:" != *":$dir:"* ]]; then
    wheel_incs="${wheel_incs:+$wheel_incs:}$dir"
  fi
done
if [ -n "$wheel_incs" ]; then
  export CPATH="${CPATH:+$CPATH:}$wheel_incs"
  log "CPATH += $wheel_incs"
fi
# One cuDNN per process: the wheel's, which torch loads (see the top of this file).
wheel_cudnn_home="$site/nvidia/cudnn"
if compgen -G "$wheel_cudnn_home/lib/libcudnn.so*" >/dev/null; then
  export CUDNN_HOME="$wheel_cudnn_home" CUDNN_PATH="$wheel_cudnn_home"
  # A .pth line runs at every start of the venv's Python (Ray workers and vLLM's included); the path is
  # written as a Python string literal, so nothing in it is evaluated.
  pth_path=$("$VENV/bin/python" -c 'import json, sys; print(json.dumps(sys.argv[1]))' "$wheel_cudnn_home")
  printf 'import os; os.environ["CUDNN_HOME"] = %s\n' "$pth_path" >"$site/mars_cudnn_home.pth"
  log "CUDNN_HOME=$wheel_cudnn_home for the build and for every process of $VENV ($site/mars_cudnn_home.pth)"
else
  log "warning: no libcudnn in $wheel_cudnn_home/lib (torch's cuDNN wheel): Transformer Engine picks its cuDNN itself"
fi

log "building $te_torch from source (no build isolation, against $VENV's CUDA torch; MAX_JOBS=${MAX_JOBS:-all cores}); this takes a while"
NVTE_PYTORCH_FORCE_BUILD=TRUE pip_pypi install --no-deps --no-build-isolation "$te_torch"
log "installing mars-megatron editable (--no-deps)"
pip_pypi install -q --no-deps -e .

# --- check --------------------------------------------------------------------------------------------
check='import os, sys, torch, megatron.core, transformer_engine, transformer_engine.pytorch, vllm, mars_megatron
print("[setup-gpu] torch", torch.__version__, "CUDA", torch.version.cuda, "| megatron-core", megatron.core.__version__,
      "| transformer-engine", transformer_engine.__version__, "| vllm", vllm.__version__)
if torch.cuda.is_available():
    torch.backends.cudnn.version()  # torch loads its cuDNN (TE loaded one at import)
    with open("/proc/self/maps") as maps:
        libs = {os.path.realpath(line.split()[-1]) for line in maps if "/libcudnn" in line}
    if len({os.path.dirname(p) for p in libs}) > 1:
        sys.exit("[setup-gpu] two cuDNNs in one process: " + ", ".join(sorted(libs)))'
log "checking: import torch, megatron.core, transformer_engine.pytorch, vllm, mars_megatron; one cuDNN"
if ! VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" -c "$check" >&2; then
  driver_old && die "environment check failed: $driver_msg"
  command -v nvidia-smi >/dev/null && die "environment check failed"
  "$VENV/bin/python" -c "import torch, megatron.core, mars_megatron" >&2 || die "environment check failed"
  log "warning: the import check above failed on a machine without a GPU (no nvidia-smi; e.g. docker build)."
  log "warning: torch, megatron.core and mars_megatron import; on a GPU node, finish the check with"
  log "warning:   $VENV/bin/python -c 'import transformer_engine.pytorch, vllm'"
  log "warning: $VENV is left without its stamp, so scripts/setup_gpu.sh there redoes the check too."
  exit 0
fi
echo "$want" >"$stamp"
log "done: $VENV"
