"""The manual stays inside the repository and in step with the code.

Every relative link in README.md, CHANGELOG.md and docs/**/*.md must resolve to a file of the repository
(and an ``#anchor`` to a heading of it); no link leaves the repository, neither by ``../`` nor as an
http(s) address (papers are cited as plain text). docs/config.md must equal what the config tree
generates, so the reference cannot drift from the fields."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from mars_megatron.config_reference import REGENERATE, config_markdown

ROOT = Path(__file__).resolve().parents[1]
MANUAL = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_URL = re.compile(r"https?://", re.IGNORECASE)
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked out unless not
    ``blank_code``."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced and not line.startswith("    "):
            out.append((number, _CODE_SPAN.sub("``", line) if blank_code else line))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = text.replace("`", "").lower()
    kept = "".join(
        c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN"
    )  # letters, digits, space, hyphen, underscore
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, numbered like GitHub's when headings repeat."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8"), blank_code=False):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = _slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def link_problems(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the links of one markdown file, one line per problem (empty: all good)."""
    problems = []
    name = path.relative_to(root)
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        if _URL.search(line):
            problems.append(f"{name}:{number}: an http(s) address; cite it as plain text instead")
        for target in _LINK.findall(line):
            if _URL.match(target) or target.startswith(("mailto:", "//")):
                continue  # already reported as an address
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.is_relative_to(root):
                problems.append(f"{name}:{number}: link {target!r} leaves the repository")
            elif not dest.exists():
                problems.append(f"{name}:{number}: link {target!r}: no such file {dest.relative_to(root)}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{name}:{number}: link {target!r}: no heading with anchor #{anchor}")
    return problems


@pytest.mark.parametrize("path", MANUAL, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_inside_the_repository(path: Path) -> None:
    assert link_problems(path) == []


def test_the_manual_is_what_it_says() -> None:
    assert (ROOT / "docs" / "README.md").exists(), "docs/README.md: the index of docs/"
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def test_link_check_finds_bad_links(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ok.md").write_text("# A heading, with `code`\n\ntext\n", encoding="utf-8")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "\n".join(
            [
                "[fine](ok.md) and [anchor](ok.md#a-heading-with-code) and [self](#title)",
                "# Title",
                "[outside](../../etc/passwd)",
                "[missing](nothing.md)",
                "[bad anchor](ok.md#no-such-heading)",
                "see https://example.org for more",
                "`https://in.code.span` and [web](http://example.org)",
                "```",
                "[in a fence](nothing.md) http://127.0.0.1:8000",
                "```",
            ]
        ),
        encoding="utf-8",
    )
    problems = link_problems(page, tmp_path)
    assert [p.split(":")[1] for p in problems] == ["3", "4", "5", "6", "7"]
    assert "leaves the repository" in problems[0] and "no such file" in problems[1]
    assert "no heading" in problems[2] and "http(s) address" in problems[3]


def test_config_reference_is_current() -> None:
    page = ROOT / "docs" / "config.md"
    assert page.read_text(encoding="utf-8") == config_markdown(), (
        f"docs/config.md is stale: the config tree changed. Regenerate it with:  {REGENERATE}"
    )
