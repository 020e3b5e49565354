"""A step whose loss or gradients are not finite is skipped and counted; the run goes on unharmed."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel
from tests.nan_workers import poisoned_and_clean


@pytest.mark.multiproc
@pytest.mark.parametrize(("layout", "world"), [({}, 1), ({"pp": 2}, 2)])
def test_nan_step_is_skipped_counted_and_harmless(tmp_path: Path, layout: dict, world: int) -> None:
    hf = str(init_model("tiny-dense", tmp_path / "dense"))
    ranks = parallel.launch(poisoned_and_clean, world, hf, layout, timeout_s=300)
    poisoned, clean = [r[0] for r in ranks], [r[1] for r in ranks]
    for rank in range(world):
        first, second, third = poisoned[rank]["steps"]
        assert (first["skipped"], second["skipped"], third["skipped"]) == (0.0, 1.0, 0.0)
        assert second["skipped_steps"] == third["skipped_steps"] == 1.0
        assert second["update_ok"] == 0.0 and math.isnan(second["loss"])
        assert poisoned[rank]["unchanged"]  # the NaN step did not touch the weights
        # Skipping is a no-op: the step after it sees the model a clean run sees after one update
        # (its optimizer state was not poisoned either).
        assert third["loss"] == pytest.approx(clean[rank]["steps"][1]["loss"], abs=1e-6)
        assert clean[rank]["steps"][2]["skipped_steps"] == 0.0
