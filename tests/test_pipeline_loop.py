"""The agentic pipeline end to end on Ray: real trainer ranks (EP2), real transformers engines, real reward
workers. Outputs reach training before their trajectories finish; the staleness bound holds; a rollout
worker and a reward worker killed mid-run are replaced, their work requeued, and every sample is
accounted for exactly once."""

from __future__ import annotations

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


def test_agentic_run_streams_keeps_the_bound_and_survives_dead_workers(
    sft_model: Path, tmp_path: Path
) -> None:
    import ray

    from mars_megatron.rl.trainer import MarsRLTrainer, prepare

    cfg = _config(sft_model, tmp_path / "run", "train.steps=5")
    with MarsRLTrainer(cfg, prepare(cfg, nproc=None, resume=None), log=print) as trainer:
        trainer.start()
        first = trainer.train_step()
        driver = trainer.driver
        assert driver is not None
        # Solver outputs were trained while the Verifiers of the same problems were still running
        assert first["samples/solver"] > 0 and first["samples/verifier"] == 0
        assert any(item.kind == "rollout" for item in driver.flight.values())
        ray.kill(driver.engines[0][1].actor)  # both die with work in flight or queued for them
        ray.kill(driver.rewards[0])
        rest = [trainer.train_step() for _ in range(4)]
        census = driver.s.census()
    assert driver.counters["rollout_restarts"] >= 1 and driver.counters["reward_restarts"] >= 1
    assert rest[-1]["pipeline/requeued"] >= 1
    for m in [first, *rest]:
        assert m["pipeline/staleness_max"] <= 1
        assert m["train/update_ok"] == 1.0
    assert any(m["pipeline/multi_version_samples"] > 0 for m in rest)  # segments carried over an update
    # every sample started is trained, waiting, or still running; none twice (the scheduler checks ids)
    assert census["spawned"] == census["trained"] + census["scored"] + census["unfinished"]
    assert census["trained"] == sum(m["samples"] for m in [first, *rest])
    assert [m["policy_version"] for m in [first, *rest]] == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_agentic_run_resumes_its_in_flight_state(sft_model: Path, tmp_path: Path) -> None:
    """The step-2 checkpoint holds sequences still in flight; --resume continues the schedule from it."""
    import torch

    from mars_megatron.rl.trainer import train

    run = tmp_path / "run"
    ckpt = [f"checkpoint.save_dir={run / 'ckpt'}", "checkpoint.save_interval=1"]
    first = train(_config(sft_model, run, "train.steps=2", *ckpt))
    state = torch.load(run / "ckpt" / "step_000002" / "pipeline_state.pt", weights_only=False)
    assert [q for q in state["scheduler"]["seqs"] if q["state"] != "done"]
    second = train(_config(sft_model, run, "train.steps=4", *ckpt), resume=True)
    assert [m["step"] for m in second] == [3, 4]
    assert [m["policy_version"] for m in second] == [3.0, 4.0]
    # the restored schedule counts on: every sample trained once across the restart
    assert second[0]["pipeline/trained_total"] == first[-1]["pipeline/trained_total"] + second[0]["samples"]


def test_agentic_pipeline_refuses_the_shared_reward(sft_model: Path, tmp_path: Path) -> None:
    from mars_megatron.config import ConfigError

    with pytest.raises(ConfigError, match=r"algorithm\.reward: the shared .* needs whole trajectories"):
        _config(sft_model, tmp_path / "a", "algorithm.reward=shared")


@pytest.fixture(scope="module", autouse=True)
def _ray_down():
    """These tests start Ray in this process; later modules start their own."""
    yield
    import ray

    ray.shutdown()
