"""Tasks for the tiny run that learns: addition problems with verifiable integer answers
(:mod:`~mars_megatron.tasks.arith`), demonstrations of the three roles with calibrated carelessness
(:mod:`~mars_megatron.tasks.demos`) and the supervised warm start with its per-role reward measurement
(:mod:`~mars_megatron.tasks.sft`).
"""

from mars_megatron.tasks.arith import arith_problems, operand_pairs, operands, problem_text, write_jsonl
from mars_megatron.tasks.demos import Demo, DemoConfig, build_demos, encode_demo
from mars_megatron.tasks.sft import SFTConfig, role_accuracy, save_sft_checkpoint, sft_job, step_batches

__all__ = [
    "Demo",
    "DemoConfig",
    "SFTConfig",
    "arith_problems",
    "build_demos",
    "encode_demo",
    "operand_pairs",
    "operands",
    "problem_text",
    "role_accuracy",
    "save_sft_checkpoint",
    "sft_job",
    "step_batches",
    "write_jsonl",
]
