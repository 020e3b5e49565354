"""docs/config.md, generated: the config reference as markdown, from ``describe_config``'s listing.

Why a generator: the config tree is the one place a setting is declared, defaulted and validated, so its
reference must not be a second hand-written copy that drifts. This module only re-lays out what
``describe_config`` prints (section headers ``[path] help``, field lines ``  path: type; default X``,
help lines indented six spaces), so it depends on nothing inside the config module but that listing.
``tests/test_docs.py`` regenerates the page and fails when docs/config.md is stale."""

from __future__ import annotations

from mars_megatron.config import describe_config

REGENERATE = "PYTHONPATH=$PWD .venv/bin/mars config --describe --format markdown > docs/config.md"

_INTRO = """\
# Configuration reference

Generated from the config tree by `mars config --describe --format markdown`; do not edit by hand.
Regenerate with `{regenerate}` (tests/test_docs.py fails while this page is stale).

A run's config is one YAML file (see `examples/`) plus `dotted.key=value` overrides on the command line,
e.g. `mars train examples/tiny_cpu.yaml parallel.ep=2 train.steps=10`. `mars config FILE [key=value ...]`
prints the resolved tree. Every field is checked when the config loads, and an error names the dotted
field and where its value came from (the file or the override). Unknown keys are refused with the
closest known one. `mars sft` reads its own small file (`examples/tiny_sft.yaml`, fields in
`mars_megatron/tasks/`).

{rule}
"""


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return text.replace("|", "\\|").strip()


def config_markdown() -> str:
    """The whole reference page: an introduction, then one table per config section."""
    lines = describe_config().splitlines()
    rule = lines[0].strip()
    out = [_INTRO.format(regenerate=REGENERATE, rule=rule).rstrip("\n")]
    field: list[str] | None = None  # [path, type, default, help...] of the field being read

    def flush() -> None:
        nonlocal field
        if field is not None:
            path, type_, default, *help_lines = field
            cells = (f"`{path}`", _cell(type_), f"`{_cell(default)}`", _cell(" ".join(help_lines)))
            out.append("| " + " | ".join(cells) + " |")
        field = None

    for line in lines[1:]:
        if not line.strip():
            continue
        if line.startswith("["):
            flush()
            name, _, help_text = line[1:].partition("] ")
            out += ["", f"## `{name}`", "", help_text.strip(), "", "| field | type | default | meaning |"]
            out.append("|---|---|---|---|")
        elif line.startswith("      "):
            if field is None:
                raise ValueError(f"describe_config: help line outside a field: {line!r}")
            field.append(line.strip())
        elif line.startswith("  "):
            flush()
            path, _, rest = line.strip().partition(": ")
            type_, _, default = rest.rpartition("; default ")
            field = [path, type_, default]
        else:
            raise ValueError(f"describe_config: unexpected line {line!r}")
    flush()
    return "\n".join(out) + "\n"
