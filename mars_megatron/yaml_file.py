"""Reading YAML that comes from users (run configs, overrides, agent graph files) strictly.

A config or graph file may come from anywhere, and PyYAML's safe loader, though it runs no code, still
lets a file do harm or mislead: an alias bomb ("billion laughs": nine anchors of nine aliases each) is a
few hundred bytes that stand for 9^9 values, cheap to parse but hanging whatever walks them next (the
checks, ``mars config``'s print); a key given twice keeps the last silently (a second ``lr:`` or a
duplicate loop step wins over the first without a word); a file saved as UTF-16 or with bytes that are not
UTF-8 gets a decoding error that names no file. One loader answers all of these with a ValueError saying
why; each caller adds the file and its own error type.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

__all__ = ["MAX_EXPANDED_NODES", "decode_text", "parse_yaml", "read_yaml"]

MAX_EXPANDED_NODES = 100_000
"""Most values a document may stand for once its aliases are expanded (the largest shipped config has
about 300): an alias bomb is refused after parsing, before anything walks it."""
_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16",
         b"\xfe\xff": "UTF-16"}  # fmt: skip


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-6`` (no dot) as a float, as YAML 1.2 does, refuses a key given
    twice in one mapping, and refuses a document whose aliases expand past :data:`MAX_EXPANDED_NODES`."""

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            size = _expanded(node, {})
            if size > MAX_EXPANDED_NODES:
                raise ValueError(
                    f"its aliases expand to more than {MAX_EXPANDED_NODES:,} values (an alias bomb?); "
                    "write the values out instead"
                )
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may repeat
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # the base class refuses it ("found unhashable key")
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _expanded(node: yaml.Node, memo: dict[int, int]) -> int:
    """How many values ``node`` stands for with every alias expanded (an alias is the very node object it
    names, so the count is memoised by identity: linear in the document, not in its expansion)."""
    key = id(node)
    if key not in memo:
        memo[key] = 1  # a node that contains itself (a recursive alias) counts once
        if isinstance(node, yaml.SequenceNode):
            memo[key] = 1 + sum(_expanded(child, memo) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            memo[key] = 1 + sum(_expanded(k, memo) + _expanded(v, memo) for k, v in node.value)
    return memo[key]


def _error(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"invalid YAML{where}: {getattr(err, 'problem', None) or err}"


def parse_yaml(text: str) -> Any:
    """``text`` as YAML; every way it can fail is a ValueError with a message. PyYAML raises more than
    YAMLError: ValueError for an int of over 4300 digits and RecursionError for deep nesting."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        raise ValueError(_error(err)) from None
    except RecursionError:
        raise ValueError("invalid YAML: nested too deeply") from None
    except ValueError as err:
        raise ValueError(f"invalid YAML: {err}") from None


def decode_text(data: bytes) -> str:
    """``data`` as UTF-8 text (a UTF-8 byte-order mark dropped); a ValueError naming UTF-16/32 files and
    the offset of the first byte that is not UTF-8."""
    for bom, name in _BOMS.items():
        if data.startswith(bom):
            raise ValueError(f"{name} text (it starts with a {name} byte-order mark); save it as UTF-8")
    if len(data) >= 4 and data[0] and not data[1] and data[2] and not data[3]:
        raise ValueError("UTF-16 text without a byte-order mark (every other byte is 0); save it as UTF-8")
    try:
        return data.removeprefix(b"\xef\xbb\xbf").decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 text (byte {err.start} is 0x{data[err.start]:02x})") from None


def read_yaml(path: Path, max_bytes: int) -> Any:
    """The YAML document in ``path`` (at most ``max_bytes``, checked before reading); ValueError saying
    why it cannot be read (the caller names the file). FileNotFoundError passes through."""
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"the file is {size:,} bytes; at most {max_bytes:,} are read")
    with path.open("rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew since the stat, or a special file
        raise ValueError(f"the file is over {max_bytes:,} bytes; at most {max_bytes:,} are read")
    return parse_yaml(decode_text(data))
