#!/usr/bin/env bash
# The main job on CPU: a complete MarsRL run of the tiny Qwen3-MoE (8 to 18 minutes on 2 cores,
# after the first run's set-up).
#   1. build the random tiny model;  2. `mars sft`: warm start on careful/careless role demonstrations;
#   3. `mars train`: MarsRL (Solver -> Verifier -> Corrector, agent-specific rewards) with 2 Megatron
#      trainer ranks (EP=2) and a transformers rollout engine, all Ray actors; prints per-agent rewards,
#      and the held-out accuracy of the V–C system and of its Solver alone before, halfway and after.
# Extra arguments are config overrides for `mars train` (e.g. algorithm.reward=shared train.steps=20).
# GRAPH=imo_refine or GRAPH=tool_pair runs another shipped agent graph on its tiny task instead
# (examples/<graph>_sft.yaml, examples/<graph>_cpu.yaml). TASK=subset runs MarsRL on the subset-sum task
# (examples/subset_sft.yaml, examples/subset_cpu.yaml), where checking is easier than solving. TASK=byot
# runs the sums task brought as a user brings theirs (examples/byot/byot_cpu.yaml): Parquet with other
# column names, a reward function of the user's, W&B (offline) beside TensorBoard.
# Ray listens on every interface; as root, the run goes into a network namespace with only loopback up.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${MARS_IN_NETNS:-}" ]; then
  scripts/setup.sh
  if [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then
    exec unshare -n env MARS_IN_NETNS=1 bash -c 'ip link set lo up && exec bash "$0" "$@"' "$0" "$@"
  fi
fi
export PATH="$PWD/${MARS_VENV:-.venv}/bin:$PATH"
GRAPH=${GRAPH:-marsrl}
case "$GRAPH" in
  marsrl) SFT=examples/tiny_sft.yaml TRAIN=examples/tiny_cpu.yaml ;;
  imo_refine | tool_pair) SFT="examples/${GRAPH}_sft.yaml" TRAIN="examples/${GRAPH}_cpu.yaml" ;;
  *) echo "GRAPH must be marsrl, imo_refine or tool_pair, got '$GRAPH'" >&2; exit 2 ;;
esac
TASK=${TASK:-sums}
EVAL_EVERY=30  # held-out evaluations at steps 0, halfway and last (subset sum trains 30 steps)
case "$TASK" in
  sums) ;;
  subset)
    [ "$GRAPH" = marsrl ] || { echo "TASK=subset runs the marsrl graph, got GRAPH=$GRAPH" >&2; exit 2; }
    SFT=examples/subset_sft.yaml TRAIN=examples/subset_cpu.yaml EVAL_EVERY=15 ;;
  byot)
    [ "$GRAPH" = marsrl ] || { echo "TASK=byot runs the marsrl graph, got GRAPH=$GRAPH" >&2; exit 2; }
    TRAIN=examples/byot/byot_cpu.yaml ;;
  *) echo "TASK must be sums, subset or byot, got '$TASK'" >&2; exit 2 ;;
esac
RUN=${RUN:-runs/demo}
rm -rf "$RUN" && mkdir -p "$RUN"
mars init-model --preset tiny-moe --out "$RUN/hf"
mars sft "$SFT" --model-dir "$RUN/hf" --out "$RUN/sft"
DATA=()
if [ "$TASK" = byot ]; then
  python examples/byot/make_data.py "$RUN/data"
  DATA=(data.train_file="$RUN/data/train.parquet" evaluation.test_file="$RUN/data/test.parquet")
fi
mars train "$TRAIN" model.mcore_dir="$RUN/sft" logging.run_dir="$RUN/train" \
  checkpoint.save_dir="$RUN/checkpoints" evaluation.interval="$EVAL_EVERY" "${DATA[@]}" "$@"
echo "metrics: $RUN/train/metrics.jsonl   plot: $RUN/train/rewards.png   tensorboard: $RUN/train/tensorboard"
