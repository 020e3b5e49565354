"""The algorithm settings a run's config must refuse or carry to the loss: POIS with several updates per
batch (no trust region), the KL clamp, and the defaults the tiny run relies on."""

from pathlib import Path

import pytest

from mars_megatron.algorithm import KL_CLAMP
from mars_megatron.config import AlgorithmConfig, ConfigError, MarsConfig, TrainConfig, load_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _error(path: Path | None, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


@pytest.mark.parametrize("updates", [2, 4])
def test_pois_with_several_updates_per_batch_is_refused(updates: int) -> None:
    """POIS's old log-probs are the current model's in every mini-batch, so the ratio stays 1 and the
    clip never acts: the combination is refused, naming both settings and the ways out."""
    for overrides in (
        [f"train.updates_per_batch={updates}"],  # importance defaults to pois
        ["algorithm.importance=pois", f"train.updates_per_batch={updates}"],
    ):
        message = _error(None, overrides)
        assert f"algorithm.importance: 'pois' with train.updates_per_batch = {updates}" in message
        assert "the ratio is 1 in every mini-batch and the clip never acts" in message
        assert "use algorithm.importance=none or tis" in message
        assert "or train.updates_per_batch=1 with pois" in message


def test_pois_refusal_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  updates_per_batch: 2\nalgorithm:\n  importance: pois\n", encoding="utf-8")
    assert _error(path, []).startswith(f"{path}: algorithm.importance: 'pois' with train.updates_per_batch")
    with pytest.raises(ConfigError, match=r"train\.updates_per_batch = 2"):
        MarsConfig(train=TrainConfig(updates_per_batch=2))  # direct construction too
    MarsConfig(train=TrainConfig(updates_per_batch=2), algorithm=AlgorithmConfig(importance="none"))


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.importance=none", "train.updates_per_batch=2"],
        ["algorithm.importance=tis", "train.updates_per_batch=3"],
        ["algorithm.importance=pois", "train.updates_per_batch=1"],
        [],
    ],
)
def test_other_importance_settings_load(overrides: list[str]) -> None:
    cfg = load_config(None, overrides)
    assert isinstance(cfg, MarsConfig)


def test_tiny_run_defaults_unchanged() -> None:
    """The tiny run (pois, default updates per batch, no KL, no DMMPT) still loads, as before."""
    default = MarsConfig()
    assert default.train.updates_per_batch == 1
    assert (default.algorithm.importance, default.algorithm.kl_coef, default.algorithm.dmmpt) == (
        "pois",
        0.0,
        False,
    )
    cfg = load_config(EXAMPLES / "tiny_cpu.yaml")
    assert cfg.algorithm.importance == "pois" and cfg.train.updates_per_batch == 1
    assert cfg.algorithm.kl_coef == 0.0 and cfg.algorithm.dmmpt is False


def test_kl_clamp_setting_reaches_the_loss() -> None:
    assert MarsConfig().algorithm.kl_clamp == KL_CLAMP == 10.0
    cfg = load_config(None, ["algorithm.kl_coef=0.01", "algorithm.kl_clamp=5"])
    assert cfg.algorithm.kl_clamp == 5.0  # the section the loss reads
    assert "algorithm.kl_clamp: expected float > 0, got 0.0" in _error(None, ["algorithm.kl_clamp=0.0"])
