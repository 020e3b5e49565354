"""Loading the project's own ``torch.save`` files without running code from them.

A checkpoint directory is input: it may come from another machine, a shared filesystem or a download, and
``torch.load(weights_only=False)`` runs whatever a crafted pickle asks for. Every file the project writes
with ``torch.save`` holds tensors, numpy arrays of plain numeric types and plain containers (dict, list,
tuple, str, int, float, bool, None), so it loads under ``weights_only=True`` with numpy's array
reconstruction admitted for those dtypes only. Anything else in the file (a class, a function, an object
array) is refused with an error that names the file; nothing from it has run.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from mars_megatron.checkpoint.errors import CheckpointError

_ARRAY_DTYPES = (
    np.bool_,
    np.uint8,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
)
"""What the scheduler's state holds (token ids, log-probs, expert ids): no object dtype, which would
unpickle its elements."""


def _array_globals() -> list[Any]:
    from numpy._core.multiarray import _reconstruct

    # bytes: how an array's raw data is pickled (a plain value, nothing runs)
    return [np.ndarray, np.dtype, _reconstruct, bytes, *(type(np.dtype(t)) for t in _ARRAY_DTYPES)]


TORCH_LOAD_ERRORS: tuple[type[Exception], ...] = (
    EOFError,
    RuntimeError,  # "Invalid magic number", a zip archive without data.pkl or cut short
    OSError,
    ValueError,  # UnicodeDecodeError included
    KeyError,  # a memo lookup of a missing index ("hello" reads as opcodes: 'h' is BINGET)
    IndexError,  # an opcode that pops from an empty stack
    TypeError,
    AttributeError,
    AssertionError,
    struct.error,  # an opcode whose argument bytes are missing
)
"""What ``torch.load(weights_only=True)`` raises on bytes that are not a torch.save file (found by feeding
it random bytes, cut and flipped files and random opcode streams, torch 2.13): its restricted unpickler
interprets whatever it is given, and each malformed opcode fails in its own way. Listed rather than
``Exception`` so that a bug of ours (or a MemoryError) is not reported as a corrupt file."""


def refusal_reason(e: Exception) -> str:
    """The line of a ``weights_only`` refusal that says what was asked for (torch's message ends with it,
    after advice on how to allow it, which is not ours to give), cut to 200 characters."""
    text = str(e).strip()
    return (text.splitlines()[-1] if text else type(e).__name__)[:200]


def load_plain(path: str | Path) -> Any:
    """The object ``torch.save`` stored in ``path``, if it is made of tensors, numeric numpy arrays and plain
    containers only; :class:`CheckpointError` naming the file otherwise (or when it is missing or cut)."""
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        with torch.serialization.safe_globals(_array_globals()):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused: it holds more than tensors, numeric arrays and plain containers, so loading "
            f"it could run code; not loaded ({refusal_reason(e)})"
        ) from None
    except TORCH_LOAD_ERRORS as e:
        raise CheckpointError(
            f"{path}: unreadable or cut short, or not a torch.save file at all ({type(e).__name__}: {e})"
        ) from None
