"""Run metrics: ``metrics.jsonl``, TensorBoard scalars, the progress bar and the ``rewards.png`` plot."""

from mars_megatron.metrics.plot import moving_average, plot_rewards, plot_runs, reward_keys
from mars_megatron.metrics.records import METRICS_FILE, REWARDS_PNG, TENSORBOARD_DIR, read_metrics
from mars_megatron.metrics.sink import MetricsSink

__all__ = [
    "METRICS_FILE",
    "REWARDS_PNG",
    "TENSORBOARD_DIR",
    "MetricsSink",
    "moving_average",
    "plot_rewards",
    "plot_runs",
    "read_metrics",
    "reward_keys",
]
