"""The GPU check that fits the bare GPU machine (Python 3.12, torch, transformers; no Ray, vLLM,
Transformer Engine or math-verify): ``scripts/device_check.sh`` runs ``python -m tools.device_check``.

Importing the package blocks the packages that machine lacks when the runner asked for it
(:data:`~tools.device_check.common.ABSENT_ENV`), so processes the checks spawn block them as well.
"""

from tools.device_check.common import block_from_env

block_from_env()
