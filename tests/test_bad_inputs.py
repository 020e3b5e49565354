"""Every bad input of ``tests/bad_inputs`` is refused with a clear error naming the field, flag or file;
none runs code and none loses what was already written (see docs/bad_inputs.md; ``tools/bad_inputs.py``
prints the per-category table).

A case still failing carries the owner of the fix and runs as a strict xfail, so its fix is noticed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bad_inputs.fixtures import Fixtures
from tests.bad_inputs.harness import Case, all_cases, classify, workspace

CASES = [c for c in all_cases() if c.covered_by is None]


def _param(case: Case) -> object:
    marks = [pytest.mark.xfail(strict=True, reason=f"owner: {case.owner}")] if case.owner else []
    return pytest.param(case, id=case.id, marks=marks)


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fixtures]:
    built = Fixtures(tmp_path_factory.mktemp("bad_inputs_fixtures"))
    yield built
    built.close()


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input_is_refused_clearly(case: Case, fixtures: Fixtures, tmp_path: Path) -> None:
    with workspace(tmp_path, case, fixtures) as ws:
        result = classify(case, ws)
    assert result.outcome == "clear", f"{case.id}: {result.outcome}: {result.message}"


def test_the_suite_is_large_and_every_category_has_cases() -> None:
    every = all_cases()
    by_category = {c.category for c in every}
    assert len(every) >= 400, len(every)
    assert by_category >= {
        "configs", "data lines", "model files", "checkpoints", "conversion", "eval flags", "launch flags",
        "server requests", "sizes",
    }, by_category  # fmt: skip
