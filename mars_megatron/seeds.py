"""Seeds derived from names: every random choice of a run (which problems, which inputs a position gets,
an engine request's sampling) is seeded from what it is about, so it does not depend on the order in
which work happens to finish."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (stable across processes and Python versions, unlike ``hash``)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
