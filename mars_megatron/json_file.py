"""Reading JSON that comes from disk (checkpoint metadata, manifests, indexes, saved settings) strictly.

``json.loads`` fails in more ways than ``JSONDecodeError``: bytes that are not UTF-8 raise
``UnicodeDecodeError``, an integer of more than 4300 digits a plain ``ValueError`` (Python's limit on
int-string conversion) that names no file, and brackets nested past the recursion limit a
``RecursionError``, which is no ``ValueError`` at all and escapes every ``except`` written for bad JSON.
A checkpoint folder or a model folder may come from anywhere, so every one of these must become the
caller's own error naming the file. One reader does that for every such file, so none of them forgets a
case.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["parse_json", "read_json"]


def parse_json(text: str | bytes) -> Any:
    """``text`` as JSON; every way it can fail is a :class:`ValueError` whose message says why (without a
    file name: the caller knows where the text came from)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"not UTF-8 text (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ValueError("invalid JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of more than 4300 digits; its advice to raise the limit is dropped
        raise ValueError(f"invalid JSON ({str(e).split('; use sys.')[0]})") from None


def read_json(path: str | Path, error: Callable[[str], Exception] = ValueError) -> Any:
    """The JSON value in ``path``. A file that cannot be read or parsed raises ``error(message)``, the
    message starting with the path (``<path>: unreadable or corrupt (<why>)``), so each caller keeps its
    own error type (``CheckpointError``, ``PolicyError`` …) and the user learns which file to look at."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise error(f"{path}: unreadable or corrupt (cannot read it: {e.strerror or e})") from None
    try:
        return parse_json(data)
    except ValueError as e:
        raise error(f"{path}: unreadable or corrupt ({e})") from None
