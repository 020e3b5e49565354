"""Training checkpoints.

* the store publishes a checkpoint in one rename, names it in ``latest``, keeps the last N, clears what
  crashed runs left, never takes an incomplete directory for a checkpoint, and names the file or path
  in its errors;
* a run resumed in fresh processes from a checkpoint taken after step 2 repeats steps 3 and 4 of the
  uninterrupted run bit for bit (losses, gradient norms, weights, and the RNG draws after them), in one
  process and under EP2 and PP2 (real Megatron-Core on gloo, distributed optimizer, tiny MoE);
* loading into a different parallel layout fails with an error that names both layouts.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mars_megatron.checkpoint import (
    STATE_FILE,
    CheckpointError,
    CheckpointStore,
    checkpoint_name,
    python_rng_state,
    set_python_rng_state,
)
from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel
from tests.checkpoint_workers import POLICY, Run, run


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _commit(store: CheckpointStore, step: int, payload: bytes = b"w") -> Path:
    staging = store.begin(step)
    (staging / POLICY).mkdir()
    (staging / POLICY / "weights.bin").write_bytes(payload)
    return store.commit(staging, step, {"step": step})


# ------------------------------------------------------------------------------------------------ store
def test_commit_publishes_the_staged_directory_and_names_it_latest(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    store = CheckpointStore(root, keep_last=2)
    staging = store.begin(12)
    assert staging.parent == root and staging.name.startswith(".tmp-step_000012-")
    (staging / POLICY).mkdir()
    (staging / POLICY / "weights.bin").write_bytes(b"abc")
    assert store.latest() is None  # a staging directory is not a checkpoint

    state = {"step": 12, "policy_version": 3, "unfinished": [{"id": "q1", "tokens": [1, 2]}]}
    final = store.commit(staging, 12, state)

    assert final == root / "step_000012" and not staging.exists()
    assert (final / POLICY / "weights.bin").read_bytes() == b"abc"
    assert store.load_state(final) == state
    assert json.loads((final / STATE_FILE).read_text())["step"] == 12
    assert (root / "latest").read_text() == "step_000012\n"
    assert store.latest() == final
    assert _names(root) == ["latest", "step_000012"]  # no temporary files left behind


def test_keep_last_removes_the_oldest_complete_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    (tmp_path / "step_000000").mkdir()  # incomplete (no trainer state): never counted, never removed
    for step in (1, 2, 3, 4):
        _commit(store, step)
    assert _names(tmp_path) == ["latest", "step_000000", "step_000003", "step_000004"]
    assert [s for s, _ in store.checkpoints()] == [3, 4]
    only_one = CheckpointStore(tmp_path, keep_last=1)
    _commit(only_one, 5)
    assert [s for s, _ in only_one.checkpoints()] == [5]


def test_commit_replaces_a_checkpoint_of_the_same_step(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=3)
    _commit(store, 7, b"old")
    final = _commit(store, 7, b"new")
    assert (final / POLICY / "weights.bin").read_bytes() == b"new"
    assert _names(tmp_path) == ["latest", "step_000007"]


def test_commit_clears_crashed_staging_and_an_abandoned_later_history(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=5)
    _commit(store, 4)
    _commit(store, 10)
    crashed = store.begin(11)  # a run died while writing step 11
    (crashed / "half.bin").write_bytes(b"x")
    (tmp_path / "latest.abc.partial").write_text("step_0")  # and while rewriting `latest`
    # The run was resumed from step 4; its next checkpoint makes step 10 a history it abandoned.
    _commit(store, 6)
    assert _names(tmp_path) == ["latest", "step_000004", "step_000006"]
    assert store.latest() == tmp_path / "step_000006"


def test_abort_removes_the_staging_directory(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=1)
    staging = store.begin(3)
    (staging / "x").write_text("1")
    store.abort(staging)
    assert _names(tmp_path) == [] and store.latest() is None


def test_state_that_is_not_json_is_refused_before_anything_is_published(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=1)
    staging = store.begin(1)
    with pytest.raises(TypeError, match="step 1 is not JSON-serialisable"):
        store.commit(staging, 1, {"sample": object()})
    assert staging.exists() and store.latest() is None
    with pytest.raises(ValueError, match="not a staging directory of step 2"):
        store.commit(staging, 2, {})


def test_latest_skips_incomplete_directories(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=3)
    assert CheckpointStore(tmp_path / "absent", keep_last=1).latest() is None
    _commit(store, 2)
    (tmp_path / "step_000009").mkdir()  # e.g. copied by hand without its trainer state
    (tmp_path / ".tmp-step_000010-zz").mkdir()
    (tmp_path / ".tmp-step_000010-zz" / STATE_FILE).write_text("{}")
    assert store.latest() == tmp_path / "step_000002"


def test_missing_or_corrupt_trainer_state_names_the_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=1)
    final = _commit(store, 1)
    file = final / STATE_FILE
    file.write_text('{"format": "mars-trainer-state-v1", "step": 1, "sta')
    with pytest.raises(CheckpointError, match=re.escape(f"{file}: unreadable or corrupt")):
        store.load_state(final)
    file.write_text('{"format": "something-else"}')
    with pytest.raises(CheckpointError, match=re.escape(f"{file}: field 'format' is 'something-else'")):
        store.load_state(final)
    file.unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"{file}: missing")):
        store.load_state(final)


def test_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path / "ckpt", keep_last=3)
    assert store.resolve("latest") is None and store.resolve(True) is None  # nothing yet: a fresh start
    first, second = _commit(store, 1), _commit(store, 2)
    assert store.resolve(False) is None and store.resolve(None) is None and store.resolve("") is None
    assert store.resolve("latest") == second and store.resolve(True) == second
    assert store.resolve(str(first)) == first
    monkeypatch.chdir(tmp_path)
    assert store.resolve("step_000001") == store.root / "step_000001"  # a name under the root
    missing = tmp_path / "nowhere"
    with pytest.raises(CheckpointError, match=re.escape(f"{missing}: resume checkpoint does not exist")):
        store.resolve(str(missing))
    (first / STATE_FILE).unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"{first}: not a complete checkpoint")):
        store.resolve(first)


def test_checkpoint_names_and_store_arguments_are_validated(tmp_path: Path) -> None:
    assert checkpoint_name(12) == "step_000012"
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        checkpoint_name(-1)
    with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
        CheckpointStore(tmp_path, keep_last=0)


def test_python_rng_state_survives_json() -> None:
    rng = random.Random(5)
    rng.gauss(0, 1)  # leaves a cached second Gaussian in the state
    saved = json.loads(json.dumps(python_rng_state(rng)))
    expected = [rng.random(), rng.gauss(0, 1)]
    fresh = random.Random(0)
    set_python_rng_state(saved, fresh)
    assert [fresh.random(), fresh.gauss(0, 1)] == expected
    with pytest.raises(ValueError, match="python RNG state must be"):
        set_python_rng_state({"not": "a state"})


# ------------------------------------------------------------------------------------------ rank state
@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(init_model("tiny-moe", tmp_path_factory.mktemp("ckpt-model") / "moe"))


def _assert_exact_continuation(full: dict[str, Any], resumed: dict[str, Any], saved_after: int = 2) -> None:
    """The uninterrupted run's steps after ``saved_after`` equal the resumed run's, bit for bit."""
    expected = [(s["loss"], s["grad_norm"]) for s in full["steps"][saved_after:]]
    got = [(s["loss"], s["grad_norm"]) for s in resumed["steps"]]
    assert got == expected
    assert resumed["weights"].keys() == full["weights"].keys()
    for name, value in full["weights"].items():
        assert np.array_equal(resumed["weights"][name], value), name
    assert resumed["draws"] == full["draws"]  # python, numpy and torch RNGs resumed where they were
    assert resumed["skipped_steps"] == full["skipped_steps"] == 0


@pytest.mark.multiproc
def test_resume_in_one_process_repeats_the_uninterrupted_run(tmp_path: Path, moe: str) -> None:
    """Through the store, as the driver does it; plus, in the same processes, the non-distributed
    optimizer saved before its first step (megatron then leaves the step count out)."""
    store = CheckpointStore(tmp_path / "ckpt", keep_last=2)
    staging = store.begin(2)
    plain = {"use_distributed_optimizer": False}
    early = tmp_path / "before-first-step"
    full_runs = [Run("full", moe, {}, 1, 4, str(staging), 2), Run("plain", moe, plain, 1, 4, str(early), 0)]
    [full] = parallel.launch(run, 1, full_runs, timeout_s=300)
    store.commit(staging, 2, {"step": 2, "python_rng": python_rng_state()})

    path = store.resolve("latest")
    assert path == store.root / "step_000002" and store.load_state(path)["step"] == 2
    resumed_runs = [
        Run("full", moe, {}, 3, 4, resume_dir=str(path)),
        Run("plain", moe, plain, 1, 4, resume_dir=str(early)),
    ]
    [resumed] = parallel.launch(run, 1, resumed_runs, timeout_s=300)
    _assert_exact_continuation(full["full"], resumed["full"])
    _assert_exact_continuation(full["plain"], resumed["plain"], saved_after=0)


@pytest.mark.multiproc
def test_resume_under_ep2_pp2_and_cp2_repeats_the_uninterrupted_run(tmp_path: Path, moe: str) -> None:
    layouts = {"ep2": {"ep": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2}}
    dirs = {name: tmp_path / name for name in layouts}
    full = parallel.launch(
        run,
        2,
        [Run(name, moe, layout, 1, 4, str(dirs[name]), 2) for name, layout in layouts.items()],
        timeout_s=300,
    )
    # the EP2 checkpoint is also offered to a DP2 layout (ep=1), which must refuse it
    wrong = {"ep2": {}, "pp2": None, "cp2": None}
    runs = [
        Run(n, moe, lay, 3, 4, resume_dir=str(dirs[n]), wrong_layout=wrong[n]) for n, lay in layouts.items()
    ]
    resumed = parallel.launch(run, 2, runs, timeout_s=300)
    for rank in range(2):
        for name in layouts:
            _assert_exact_continuation(full[rank][name], resumed[rank][name])
        # refused on every rank, naming both layouts
        kind, message = resumed[rank]["ep2"]["wrong_layout_error"]
        assert kind == "CheckpointError"
        assert f"{dirs['ep2'] / POLICY}: saved with parallel layout (" in message
        assert "ep=2" in message and "ep=1" in message and "differ in ep, expert_dp" in message


# ------------------------------------------------------------------------------ files that must not run code
class _Payload:
    """Unpickling this runs ``touch MARKER`` (what a crafted checkpoint file would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        import os

        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_files_that_could_run_code_are_refused(tmp_path: Path) -> None:
    """pipeline_state.pt and the other torch.save files are loaded with weights_only and numeric numpy
    arrays only: a crafted file is refused naming it, before anything in it runs; a real schedule state
    (token ids, log-probs, uint8 expert ids, plain containers) loads unchanged; a cut file is named too."""
    from mars_megatron.checkpoint.errors import CheckpointError
    from mars_megatron.checkpoint.safe_load import load_plain

    marker = tmp_path / "ran"
    crafted = tmp_path / "pipeline_state.pt"
    torch.save({"scheduler": _Payload(str(marker)), "mode": "agentic"}, crafted)
    with pytest.raises(CheckpointError, match=r"pipeline_state\.pt: refused: .* could run code"):
        load_plain(crafted)
    assert not marker.exists()
    objects = tmp_path / "objects.pt"
    torch.save({"a": np.array([print, 1], dtype=object)}, objects)
    with pytest.raises(CheckpointError, match=r"objects\.pt: refused"):
        load_plain(objects)

    state = {
        "scheduler": {
            "seqs": [
                {
                    "prompt_ids": np.arange(5, dtype=np.int64),
                    "logprobs": np.full(3, -0.5, np.float32),
                    "routing": np.zeros((3, 2, 2), np.uint8),
                    "tokens": np.asarray([], dtype=np.int64),  # pickled with its raw bytes
                    "segments": [(0, 3, 1)],
                    "text": "x",
                    "reward": None,
                    "state": "done",
                }
            ],
            "groups": {"g": ["a", "b"]},
            "trained": [1, 2],
        },
        "counters": {"rollout_restarts": 0},
        "mode": "agentic",
        "weights": torch.ones(2),
    }
    good = tmp_path / "good.pt"
    torch.save(state, good)
    back = load_plain(good)
    seq = back["scheduler"]["seqs"][0]
    assert seq["routing"].dtype == np.uint8 and seq["prompt_ids"].tolist() == [0, 1, 2, 3, 4]
    assert seq["segments"] == [(0, 3, 1)] and back["mode"] == "agentic" and back["weights"].tolist() == [1, 1]

    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"cut\.pt: unreadable or cut short"):
        load_plain(cut)
    with pytest.raises(CheckpointError, match=r"none\.pt: missing"):
        load_plain(tmp_path / "none.pt")
