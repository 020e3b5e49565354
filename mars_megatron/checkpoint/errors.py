"""The one error of a checkpoint or model folder that cannot be used.

Why a module of its own: every layer that reads a checkpoint (safetensors I/O in ``conversion``, manifests,
dist checkpoints, rank state, ``mars convert``) raises it, and each such reader sits above this one.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file that is missing, unreadable or does not hold what the model needs."""
