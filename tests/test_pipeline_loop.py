"""The agentic pipeline end to end on Ray: real trainer ranks (EP2), real transformers engines, real reward
workers. Outputs reach training before their trajectories finish; the staleness bound holds; a rollout
worker and a reward worker killed mid-run, then another pair hung (``SIGSTOP``), are replaced, their work
requeued, and every sample is accounted for exactly once."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from itertools import pairwise
from pathlib import Path

import pytest

from mars_megatron.config import load_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_cpu.yaml"
DATA = REPO / "examples" / "data" / "arith_train.jsonl"


def _config(model: Path, run: Path, *extra: str):
    return load_config(
        EXAMPLE,
        [f"model.mcore_dir={model}", f"data.train_file={DATA}", f"logging.run_dir={run}",
         "pipeline.mode=agentic", "pipeline.segment_tokens=8", "data.problems_per_step=4", *extra],
    )  # fmt: skip


HUNG_S = 15  # the rollout and reward deadlines of the test below: a call takes ~1 s here


def _pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def _state(pid: int) -> str:
    """A process's state letter (``T``: stopped), or "gone" when it has ended (a zombie included)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    return "gone" if state in ("Z", "X") else state


def test_agentic_run_streams_keeps_the_bound_and_survives_dead_and_hung_workers(
    sft_model: Path, tmp_path: Path
) -> None:
    import ray

    from mars_megatron.pipeline.trainer import MarsRLTrainer, prepare

    deadlines = [f"pipeline.rollout_timeout_s={HUNG_S}", f"pipeline.reward_timeout_s={HUNG_S}"]
    cfg = _config(sft_model, tmp_path / "run", "train.steps=7", "pipeline.transfer_timeout_s=10", *deadlines)
    with MarsRLTrainer(cfg, prepare(cfg, nproc=None, resume=None), log=print) as trainer:
        trainer.start()
        first = trainer.train_step()
        driver = trainer.driver
        assert driver is not None
        # Solver outputs were trained while the Verifiers of the same problems were still running
        assert first["samples/solver"] > 0 and first["samples/verifier"] == 0
        # ... and their trajectories go on: the Verifiers of those solutions exist, untrained
        assert any(q.role == "verifier" for q in driver.scheduler.samples.values())
        ray.kill(driver.fleet.engines[0][1].actor)  # both die with work in flight or queued for them
        ray.kill(driver.rewards.actors[0])
        rest = [trainer.train_step() for _ in range(4)]
        restarts = dict(driver.counters)
        assert restarts["rollout_restarts"] >= 1 and restarts["reward_restarts"] >= 1
        # hung, not dead: the processes stopped, with work in flight or queued for them. Found by the
        # deadlines (a generate or score call past them, or the engine's idle check before a push), killed
        # and replaced like dead ones.
        stopped = [_pid(driver.fleet.engines[0][1].actor), _pid(driver.rewards.actors[0])]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            rest += [trainer.train_step() for _ in range(2)]
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        print(f"2 updates with an engine and a reward worker hung: {time.monotonic() - t0:.1f} s")
        census = driver.scheduler.census()
        # replaced, and their processes ended: a stopped process outlives ray.kill (mars_megatron.reaper)
        assert [_state(pid) for pid in stopped] == ["gone", "gone"]
    assert driver.counters["rollout_restarts"] > restarts["rollout_restarts"]
    assert driver.counters["reward_restarts"] > restarts["reward_restarts"]
    assert driver.counters["reward_timeouts"] >= 1  # the stopped worker is given a batch, and never answers
    assert rest[-1]["pipeline/rollout_timeouts"] == driver.counters["rollout_timeouts"]
    assert rest[-1]["pipeline/requeued"] >= 1
    for m in [first, *rest]:
        assert m["pipeline/staleness_max"] <= 1
        assert m["train/update_ok"] == 1.0
    # engines decoded while updates trained (a running count): during the first, and again later. Not
    # during every update: the updates right after the kill can end before the restarted engine has
    # decoded (seen with two test workers sharing the cores: [12, 12, 12, 16, 20]). Whether a sequence is
    # still mid-decode when an update ends follows timing here too (the tiny engines usually finish first;
    # CI once saw none in 4 updates), so carrying segments over an update is asserted where it is certain,
    # in test_pipeline_scheduler, and with real engines in the R3 test below (13, 4+5 carried in its runs)
    during = [m["pipeline/segments_during_update"] for m in [first, *rest]]
    assert during[0] > 0 and all(b >= a for a, b in pairwise(during)) and during[-1] > during[0], during
    # every sample started is trained, waiting, or still running; none twice (the scheduler checks ids)
    assert census["spawned"] == census["trained"] + census["scored"] + census["unfinished"]
    assert census["trained"] == sum(m["samples"] for m in [first, *rest])
    assert [m["policy_version"] for m in [first, *rest]] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def test_agentic_run_resumes_its_in_flight_state(sft_model: Path, tmp_path: Path) -> None:
    """The step-2 checkpoint holds sequences still in flight; --resume continues the schedule from it. The
    schedule's file loads without unpickling anything but tensors, numeric arrays and containers."""
    from mars_megatron.checkpoint.safe_load import load_plain
    from mars_megatron.pipeline.trainer import in_flight, train

    run = tmp_path / "run"
    ckpt = [f"checkpoint.save_dir={run / 'ckpt'}", "checkpoint.save_interval=1"]
    first = train(_config(sft_model, run, "train.steps=2", *ckpt))
    state = load_plain(run / "ckpt" / "step_000002" / "pipeline_state.pt")
    # outputs not yet trained: still decoding or scoring, or scored and queued for the next update (which
    # of the two depends on how fast the trainer is against the engines)
    assert in_flight(state["scheduler"])
    second = train(_config(sft_model, run, "train.steps=4", *ckpt), resume=True)
    assert [m["step"] for m in second] == [3, 4]
    assert [m["policy_version"] for m in second] == [3.0, 4.0]
    # the restored schedule counts on: every sample trained once across the restart
    assert second[0]["pipeline/trained_total"] == first[-1]["pipeline/trained_total"] + second[0]["samples"]


def _rollouts(run: Path) -> list[list[dict]]:
    from mars_megatron.pipeline.agents import read_rollouts

    return read_rollouts(run / "rollouts")


def test_sync_is_the_agentic_pipeline_at_staleness_zero(sft_model: Path, tmp_path: Path) -> None:
    """Same seed, same data: ``pipeline.mode=sync`` and ``agentic`` with every bound 0 train the same
    samples (ids, tokens, rewards, advantages, in the same order) and so take the same steps, though the
    agentic run decodes and scores on twice the workers with other timings."""
    from mars_megatron.pipeline.trainer import train

    common = ["train.steps=2", "logging.rollouts=true", "pipeline.segment_tokens=8"]
    sync = train(_config(sft_model, tmp_path / "sync", *common, "pipeline.mode=sync"))
    agentic = train(
        _config(sft_model, tmp_path / "agentic", *common, "pipeline.max_staleness=0",
                "pipeline.rollout_workers=2", "pipeline.reward_workers=2")
    )  # fmt: skip
    a, b = _rollouts(tmp_path / "sync"), _rollouts(tmp_path / "agentic")
    assert len(a) == len(b) == 2 and all(len(x) > 0 for x in a)
    keys = [
        "sample_id",
        "position",
        "group_id",
        "prompt_ids",
        "response_ids",
        "reward",
        "advantage",
        "segments",
    ]
    for x, y in zip(a, b, strict=True):
        assert [[r[k] for k in keys] for r in x] == [[r[k] for k in keys] for r in y]
    assert any(len(r["segments"]) > 1 for r in a[0])  # responses really were decoded in segments
    for m, n in zip(sync, agentic, strict=True):
        assert m["train/loss"] == n["train/loss"] and m["train/grad_norm"] == n["train/grad_norm"]
        assert m["pipeline/staleness_max"] == n["pipeline/staleness_max"] == 0


def test_agentic_shared_reward_trains_whole_trajectories(sft_model: Path, tmp_path: Path) -> None:
    """``algorithm.reward=shared`` in agentic mode: a group waits for its whole trajectory tree, then
    trains on the tree's outcome. At staleness 0, so which trajectories exist does not depend on timing
    (with 1, whether a Corrector2 output reached the first 2 updates varied from run to run, and a loaded
    CI run had none); the scheduler tests hold groups across updates at staleness >= 1."""
    from mars_megatron.pipeline.trainer import train

    run = tmp_path / "run"
    metrics = train(
        _config(
            sft_model,
            run,
            "train.steps=2",
            "logging.rollouts=true",
            "algorithm.reward=shared",
            "pipeline.max_staleness=0",
        )
    )
    assert all(m["train/update_ok"] == 1.0 and "train_reward/verifier" in m for m in metrics)
    records = {r["sample_id"]: r for step in _rollouts(run) for r in step}
    checked = {"verifier": 0, "corrector_2": 0}
    for r in records.values():
        parent = records.get(r["parent_id"] or "")
        if r["position"].startswith("verifier") and r["verdict"] is True and parent is not None:
            assert r["reward"] == parent["agent_reward"]  # its trajectory ends with the solution it judged
            checked["verifier"] += 1
        if r["position"] == "corrector_2":  # the last position: its trajectory ends with it
            assert r["reward"] == r["agent_reward"]
            checked["corrector_2"] += 1
    assert all(checked.values()), checked
    assert any(r["reward"] != r["agent_reward"] for r in records.values())


def test_agentic_r3_replays_each_sequences_engine_routing(sft_model: Path, tmp_path: Path) -> None:
    """``moe.routing_replay=R3`` in agentic mode with a bf16 engine beside the fp32 trainer: the engines'
    routing travels with every segment into the trainer, and the per-role mismatch is measured, small but
    not zero (bf16 rounding is the only difference left). Whether a sequence is carried over an update here
    follows timing (a fresh clone under load saw none in 3 steps), so routing across updates is asserted
    where it is deterministic: a later segment's routing replaces the sequence's
    (test_pipeline_scheduler)."""
    from mars_megatron.pipeline.trainer import train

    metrics = train(
        _config(sft_model, tmp_path / "run", "train.steps=3", "moe.routing_replay=R3",
                "rollout.dtype=bfloat16")
    )  # fmt: skip
    assert all(m["train/update_ok"] == 1.0 for m in metrics)
    for role in ("solver", "verifier", "corrector"):
        seen = [
            m[f"train/mismatch/{role}/abs_mean"] for m in metrics if f"train/mismatch/{role}/abs_mean" in m
        ]
        assert seen and all(0 < x < 0.05 for x in seen), (role, seen)
    assert all(0 <= m["train/routing_changed"] < 0.5 for m in metrics)


@pytest.fixture(scope="module", autouse=True)
def _ray_down():
    """These tests start Ray in this process; later modules start their own."""
    yield
    import ray

    ray.shutdown()
