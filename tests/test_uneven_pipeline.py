"""Pipeline stages with unequal layer counts (Qwen3-235B's 94 layers do not split over 8 stages)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mars_megatron.config import ConfigError, ParallelConfig
from mars_megatron.models.hf_config import load_hf_config
from mars_megatron.models.layout import LayoutError, check_parallel, stage_layers
from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel
from tests.uneven_workers import convert_and_score

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    ("layers", "pp", "first", "last", "expected"),
    [
        (4, 1, None, None, [4]),
        (4, 2, None, None, [2, 2]),
        (3, 2, 1, None, [1, 2]),
        (3, 2, None, 1, [2, 1]),
        (94, 8, 11, 11, [11, 12, 12, 12, 12, 12, 12, 11]),
        (10, 3, 2, None, [2, 4, 4]),
    ],
)
def test_stage_layers(layers: int, pp: int, first: int | None, last: int | None, expected: list[int]) -> None:
    assert stage_layers(layers, pp, first, last) == expected


@pytest.mark.parametrize(
    ("layers", "pp", "first", "last", "field"),
    [
        (94, 8, None, None, "parallel.pp"),
        (94, 8, 10, 11, "parallel.first_stage_layers/last_stage_layers"),
        (3, 2, 1, 1, "parallel.first_stage_layers/last_stage_layers"),
        (3, 2, 4, None, "parallel.first_stage_layers/last_stage_layers"),
    ],
)
def test_impossible_splits_name_the_field(
    layers: int, pp: int, first: int | None, last: int | None, field: str
) -> None:
    with pytest.raises(LayoutError, match=rf"^{field}: {layers} layers cannot be split over pp={pp} stages"):
        stage_layers(layers, pp, first, last)


def test_stage_counts_need_pipeline_parallelism() -> None:
    with pytest.raises(ConfigError, match="first_stage_layers: needs pp > 1"):
        ParallelConfig(first_stage_layers=2)
    with pytest.raises(LayoutError, match=r"^parallel\.last_stage_layers: needs pp > 1"):
        stage_layers(4, 1, None, 2)  # Megatron: no middle stage left for the other layers


def test_qwen3_235b_example_layout_splits_its_94_layers() -> None:
    from mars_megatron.config import load_config

    cfg = load_config(EXAMPLES / "qwen3_235b_a22b.yaml")
    arch = load_hf_config(EXAMPLES / "hf_configs" / "qwen3-235b-a22b.json")
    check_parallel(arch, cfg.parallel, cfg.model.vocab_pad_multiple)  # raises if it cannot be built
    p = cfg.parallel
    assert sum(stage_layers(arch.num_layers, p.pp, p.first_stage_layers, p.last_stage_layers)) == 94


@pytest.mark.multiproc
def test_uneven_stages_convert_exactly_and_score_like_transformers(tmp_path: Path) -> None:
    hf = init_model("tiny-moe", tmp_path / "hf", overrides={"num_hidden_layers": 3})
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 1019, (n,), generator=g).tolist() for n in (9, 14, 5)]
    results = parallel.launch(
        convert_and_score, 2, str(hf), str(tmp_path / "mcore"), str(tmp_path / "out"), seqs, timeout_s=300
    )
    src: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for f in hf.glob("*.safetensors"):
        src.update(load_file(f))
    for f in (tmp_path / "out").glob("*.safetensors"):
        out.update(load_file(f))
    assert src.keys() == out.keys()
    assert all(torch.equal(src[k], out[k]) and src[k].dtype == out[k].dtype for k in src)
    got = results[1]  # the last stage returns the log-probs
    assert results[0] is None and got is not None
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        for seq, lp in zip(seqs, got, strict=True):
            ref = torch.log_softmax(model(torch.tensor([seq])).logits[0], -1)[
                torch.arange(len(seq) - 1), seq[1:]
            ]
            torch.testing.assert_close(torch.tensor(lp), ref, rtol=0, atol=1e-4)
