"""The README's reward function: the tiny sums task scored by the integer in the last \\boxed{}."""

from mars_megatron.rewards.answers import extract_boxed


def score(request):
    """1.0 when the last \\boxed{} of the response (after any thinking) holds the reference integer."""
    answer = extract_boxed(request.response)
    try:
        return float(answer is not None and int(answer) == int(request.reference))
    except ValueError:  # the box holds something else than an integer
        return 0.0
