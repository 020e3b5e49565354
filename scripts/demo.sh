#!/usr/bin/env bash
# The main job on CPU: build the tiny Qwen3-MoE, convert it to a Megatron distributed checkpoint with
# expert parallelism 2, and train it with Megatron-Core on 2 gloo processes, printing the loss per step.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/${MARS_VENV:-.venv}/bin:$PATH"
RUN=${RUN:-runs/demo}
rm -rf "$RUN" && mkdir -p "$RUN"
mars init-model --preset tiny-moe --out "$RUN/hf"
mars convert hf-to-mcore "$RUN/hf" "$RUN/mcore" --ep 2
mars train examples/tiny_moe_cpu.yaml model.mcore_dir="$RUN/mcore" logging.run_dir="$RUN/train" "$@"
echo "metrics: $RUN/train/metrics.jsonl"
