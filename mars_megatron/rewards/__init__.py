"""Rewards: final-answer extraction, math-verify checks in worker processes, per-agent rewards."""

from mars_megatron.rewards.agent_rewards import answer_reward, answer_rewards, verdict_reward
from mars_megatron.rewards.answers import extract_boxed, normalize_reference
from mars_megatron.rewards.checker import AnswerChecker, CheckerConfig, CheckerCounters, CheckResult

__all__ = [
    "AnswerChecker",
    "CheckResult",
    "CheckerConfig",
    "CheckerCounters",
    "answer_reward",
    "answer_rewards",
    "extract_boxed",
    "normalize_reference",
    "verdict_reward",
]
