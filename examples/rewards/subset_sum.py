"""The subset-sum task's checker (the task added for MarsRL's table) as a reward function: any subset of
the listed numbers that reaches the target is right, not one stored answer. The data's reference is
``subset_sum: 1 3 4 6 8 = 13`` (examples/data/subset_train.jsonl); the answer in the last ``\\boxed{}``
is the chosen numbers (``4+9``, ``4, 9``).

    mars train examples/subset_cpu.yaml \\
        algorithm.reward_functions.solver=examples/rewards/subset_sum.py:score \\
        algorithm.reward_functions.corrector=examples/rewards/subset_sum.py:score
"""

from mars_megatron.rewards.answers import extract_boxed
from mars_megatron.rewards.functions import RewardResult
from mars_megatron.rewards.subset_sum import check_answer, parse_reference


def score(request):
    problem = parse_reference(request.reference)  # a malformed reference raises: counted as "error"
    answer = extract_boxed(request.response)
    verdict = None if answer is None else check_answer(answer, problem)
    return RewardResult(
        score=1.0 if verdict else 0.0,
        details={
            "no_answer": float(answer is None),
            "unreadable": float(answer is not None and verdict is None),
        },
    )
