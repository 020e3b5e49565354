#!/usr/bin/env bash
# The first command to run on a GPU node: every `gpu` test, then a 10-step tiny MarsRL run on the GPU
# (Transformer Engine spec, a vLLM engine sharing the GPU), and one table of what passed, the step time,
# the peak memory per GPU and the trainer-vs-engine log-prob mismatch (also in runs/gpu_check/summary.md).
# Runs in the environment scripts/setup_gpu.sh made (MARS_VENV, default .venv) or, inside the container of
# docker/Dockerfile, in the container's. Arguments go to tools/gpu_check.py (--steps N, --out DIR,
# --skip-tests). Exit status 0 only when everything passed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MARS_VENV:-.venv}
if [ -x "$VENV/bin/python" ]; then
  export PATH="$PWD/$VENV/bin:$PATH"
fi
exec python tools/gpu_check.py "$@"
