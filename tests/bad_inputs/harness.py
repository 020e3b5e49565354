"""Bad-input cases as data, and the one classifier that judges each of them.

A :class:`Case` feeds one hostile or broken input to the real entry point that reads it (an in-process
call of ``load_problems``, ``load_hf_config``, ``cli.main`` …, or now and then the ``mars`` command in a
subprocess) and says which names (the field, flag or file) a clear refusal must contain. :func:`classify`
runs it and returns one outcome:

- ``clear``: an error of the kinds the ``mars`` command answers with exit 2 (``ValueError`` and its
  subclasses such as ``ConfigError``, ``FileNotFoundError``, ``FileExistsError``), or a CLI exit 1/2 without a
  traceback, or an HTTP 4xx, or, for data lines that are skipped by design, a warning, whose message holds
  every expected name;
- ``unclear``: such an error whose message misses a name;
- ``accepted``: no error at all for an input that must be refused;
- ``traceback``: any other exception escaped (a ``KeyError``, ``TypeError``, ``UnpicklingError``…: nothing
  anticipated it), a ``Traceback`` printed by the CLI, or an HTTP 5xx;
- ``data lost``: a file that existed before the case under one of its ``preserve`` folders changed or
  vanished, even though the input was refused;
- ``code executed``: the case's canary file exists afterwards (hostile inputs try to create it through
  pickle ``__reduce__``, shell text, YAML tags, remote-code hooks, template escapes).

The last two outrank the others. Cases that another test file already runs carry ``covered_by``: the
tally counts them, ``tests/test_bad_inputs.py`` leaves them to that file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OUTCOMES = ("clear", "unclear", "accepted", "traceback", "data lost", "code executed")
PROJECT_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, FileExistsError)
"""What ``mars`` answers with ``error: …`` and exit 2 (ConfigError, HFConfigError, CheckpointError,
RequestError, PolicyError are ValueErrors)."""
MARKER = "PWNED"
YAML_TAG = f"!!python/object/apply:os.system ['touch {MARKER}']"
"""A YAML value that would run a shell command, were YAML loaded unsafely (it creates the canary)."""


@dataclass(frozen=True)
class CliRun:
    """What a command printed and returned (a subprocess, or ``cli.main`` called in-process)."""

    rc: int
    stderr: str
    stdout: str = ""


@dataclass(frozen=True)
class HttpReply:
    status: int
    message: str


@dataclass(frozen=True)
class Case:
    category: str
    name: str
    feed: Callable[[Workspace], Any]
    """Feeds the input to the real entry point; returns normally (maybe a CliRun/HttpReply) or raises."""
    names: tuple[str, ...] = ()
    """Every one must appear in the error (``{ws}`` is replaced by the workspace path)."""
    errors: tuple[type[BaseException], ...] = PROJECT_ERRORS
    warning: bool = False
    """A skipped line is refused by a warning naming it rather than by an error."""
    preserve: tuple[str, ...] = ()
    """Folders (relative to the workspace) whose files must be unchanged after the refusal."""
    owner: str | None = None
    """Still fails, and whose files the fix belongs to: xfail(strict) in the test."""
    covered_by: str | None = None
    cli: bool = False
    """Spawns ``mars`` (seconds each): kept to a few per category."""
    needs: tuple[str, ...] = ()
    """Shared fixtures the case uses (``loopback`` = a listening socket on 127.0.0.1)."""

    @property
    def id(self) -> str:
        return f"{self.category}/{self.name}"


@dataclass
class Result:
    outcome: str
    message: str


@dataclass
class Workspace:
    """A fresh folder per case, and the shared fixtures (built once; copy them before mutating)."""

    root: Path
    fixtures: Any

    @property
    def marker(self) -> Path:
        return self.root / MARKER

    def path(self, name: str) -> Path:
        return self.root / name

    def write(self, name: str, data: str | bytes) -> Path:
        p = self.root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            p.write_bytes(data)
        else:
            p.write_text(data, encoding="utf-8")
        return p

    def copy(self, fixture: str, name: str | None = None) -> Path:
        src = Path(getattr(self.fixtures, fixture))
        dst = self.root / (name or fixture)
        shutil.copytree(src, dst, symlinks=True)
        return dst


def _snapshot(root: Path) -> dict[str, str]:
    if not root.exists():
        return {}
    if root.is_file():
        return {"": hashlib.sha256(root.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _names_in(text: str, names: tuple[str, ...], ws: Workspace) -> bool:
    return all(n.replace("{ws}", str(ws.root)) in text for n in names)


def mars(*args: str | Path, cwd: Path = REPO, timeout: int = 300) -> CliRun:
    """The real ``mars`` command in a subprocess."""
    r = subprocess.run(
        [sys.executable, "-m", "mars_megatron.cli", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return CliRun(r.returncode, r.stderr, r.stdout)


def mars_main(*args: str | Path, main: Callable[[list[str]], int] | None = None) -> CliRun:
    """``mars_megatron.cli.main`` in this process (argparse's exit 2 included), its stderr captured."""
    if main is None:
        from mars_megatron.cli import main
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return CliRun(rc, err.getvalue(), out.getvalue())


def classify(case: Case, ws: Workspace) -> Result:
    """Run ``case`` in ``ws`` and judge what happened (see the module docstring)."""
    before = {p: _snapshot(ws.root / p) for p in case.preserve}
    error: BaseException | None = None
    value: Any = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = case.feed(ws)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # torch.distributed.checkpoint raises BaseExceptions too
            error = e
    for marker in (ws.marker, Path.cwd() / MARKER, REPO / MARKER):  # shell text says "touch PWNED" (cwd)
        if marker.exists():
            if marker != ws.marker:
                marker.unlink()
            return Result("code executed", f"{marker} was created")
    for p, files in before.items():
        after = _snapshot(ws.root / p)
        lost = sorted(k for k, digest in files.items() if after.get(k) != digest)
        if lost:
            return Result("data lost", f"{p}: changed or removed: {', '.join(lost[:5])}")
    if error is not None:
        message = f"{type(error).__name__}: {error}"
        if not isinstance(error, case.errors):
            return Result("traceback", message)
        return Result("clear" if _names_in(str(error), case.names, ws) else "unclear", message)
    if isinstance(value, CliRun):
        message = (value.stderr.strip() or value.stdout.strip())[-2000:]
        if value.rc == 0:
            return Result("accepted", message)
        if "Traceback (most recent call last)" in value.stderr:
            return Result("traceback", message)
        ok = value.rc in (1, 2) and "error" in value.stderr and _names_in(value.stderr, case.names, ws)
        return Result("clear" if ok else "unclear", message)
    if isinstance(value, HttpReply):
        message = f"HTTP {value.status}: {value.message}"
        if value.status < 400:
            return Result("accepted", message)
        if value.status >= 500:
            return Result("traceback", message)
        return Result("clear" if _names_in(value.message, case.names, ws) else "unclear", message)
    if case.warning:
        texts = [str(w.message) for w in caught]
        for text in texts:
            if _names_in(text, case.names, ws):
                return Result("clear", text)
        if texts:
            return Result("unclear", "; ".join(texts)[:2000])
    return Result("accepted", repr(value)[:500])


# ------------------------------------------------------------------------------------------------ registry
def all_cases() -> list[Case]:
    """Every case of every category module, in a stable order."""
    from tests.bad_inputs import (
        checkpoints,
        configs,
        conversion,
        data_files,
        data_lines,
        eval_flags,
        launch_flags,
        model_files,
        reward_functions,
        server,
        sizes,
        task_files,
        trackers,
    )

    out: list[Case] = []
    for module in (
        configs,
        data_lines,
        data_files,
        model_files,
        checkpoints,
        conversion,
        eval_flags,
        launch_flags,
        server,
        trackers,
        reward_functions,
        sizes,
        task_files,
    ):
        out.extend(module.cases())
    ids = [c.id for c in out]
    if len(ids) != len(set(ids)):
        raise ValueError("duplicate case ids")
    return out


@contextlib.contextmanager
def workspace(base: Path, case: Case, fixtures: Any) -> Iterator[Workspace]:
    root = base / re.sub(r"[^A-Za-z0-9_.-]", "_", case.id)  # a plain name: some checks refuse odd paths
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    try:
        yield Workspace(root, fixtures)
    finally:
        shutil.rmtree(root, ignore_errors=True)
