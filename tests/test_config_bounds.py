"""Config bounds and finiteness: every field refuses non-finite, absurd and mistyped values with its dotted
name (mars_megatron.config: the declared bounds and the two type rules of _check_bounds), and the YAML
reader turns every malformed file into a ConfigError."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest

from mars_megatron.config import (
    INT_MAX,
    MAX_TOKENS,
    SEED_MAX,
    ConfigError,
    MarsConfig,
    Section,
    _field,
    describe_config,
    load_config,
)
from mars_megatron.tasks.sft import SFTConfig


def leaves(cls: type[Section], prefix: str = "") -> Iterator[tuple[str, set[type]]]:
    """(dotted path, the scalar types its hint admits) of every leaf field under ``cls``."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, path = hints[f.name], f"{prefix}{f.name}"
        if isinstance(hint, type) and issubclass(hint, Section):
            yield from leaves(hint, path + ".")
            continue
        args = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
        kinds = {get_origin(a) or a for a in args} - {type(None)}
        yield path, kinds


MARS_LEAVES = list(leaves(MarsConfig))
SFT_LEAVES = list(leaves(SFTConfig))


def error_of(overrides: list[str], root: type[Section] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, root=root)
    return err.value


def _numeric(kinds: set[type]) -> bool:
    return bool(kinds & {int, float})


@pytest.mark.parametrize(
    ("root", "path", "kinds"),
    [(MarsConfig, p, k) for p, k in MARS_LEAVES] + [(SFTConfig, p, k) for p, k in SFT_LEAVES],
)
def test_every_field_refuses_hostile_values_by_name(root: type[Section], path: str, kinds: set[type]) -> None:
    """nan, inf, -inf, 2**100, a bool (for a number), a list (for a scalar): each a ConfigError naming the
    field, never a traceback and never accepted."""
    hostile: list[str] = []
    if float in kinds:
        hostile += [".nan", ".inf", "-.inf", "1e400"]
    if int in kinds:
        hostile += [str(2**100), "-" + str(2**100), "true"]
    if kinds & {int, float, str, bool, Literal}:
        hostile += ["[1]"]
    if not hostile:  # dict fields: a scalar is refused
        hostile = ["1"]
    for value in hostile:
        err = error_of([f"{path}={value}"], root)
        assert err.path == path, (value, str(err))
        assert err.source == f"override '{path}={value}'"


@pytest.mark.parametrize("path", [p for p, k in MARS_LEAVES if float in k])
def test_non_finite_float_message(path: str) -> None:
    assert error_of([f"{path}=.inf"]).message == "expected a finite float, got inf"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # the three
        ("optimizer.lr=.inf", "optimizer.lr: expected a finite float, got inf"),
        ("rollout.temperature=.inf", "rollout.temperature: expected a finite float, got inf"),
        (f"train.seed={2**100}", f"train.seed: expected int <= {SEED_MAX}, got {2**100}"),
        # seeds: numpy's [0, 2**32) for the trainer, mars eval's [0, 2**31) for evaluation
        (f"train.seed={2**32}", f"train.seed: expected int <= {SEED_MAX}, got {2**32}"),
        ("train.seed=-1", "train.seed: expected int >= 0, got -1"),
        (f"evaluation.seed={2**31}", f"evaluation.seed: expected int <= {2**31 - 1}, got {2**31}"),
        # upper bounds the fields imply
        ("optimizer.lr=2", "optimizer.lr: expected float <= 1, got 2.0"),
        ("optimizer.weight_decay=1.5", "optimizer.weight_decay: expected float <= 1, got 1.5"),
        ("optimizer.adam_beta1=1", "optimizer.adam_beta1: expected float < 1, got 1.0"),
        ("optimizer.adam_eps=10", "optimizer.adam_eps: expected float <= 1, got 10.0"),
        ("rollout.top_p=1.5", "rollout.top_p: expected float <= 1, got 1.5"),
        ("evaluation.top_p=2", "evaluation.top_p: expected float <= 1, got 2.0"),
        ("rollout.temperature=1e6", "rollout.temperature: expected float <= 10, got 1000000.0"),
        ("evaluation.temperature=11", "evaluation.temperature: expected float <= 10, got 11.0"),
        (
            "rollout.gpu_memory_utilization=1.01",
            "rollout.gpu_memory_utilization: expected float <= 1, got 1.01",
        ),
        ("algorithm.clip_low=1", "algorithm.clip_low: expected float < 1, got 1.0"),
        ("algorithm.dmmpt_prob_threshold=1", "algorithm.dmmpt_prob_threshold: expected float < 1, got 1.0"),
        ("agents.max_steps=0", "agents.max_steps: expected a positive int, got 0"),
        ("optimizer.clip_grad=1e300", "optimizer.clip_grad: expected float <= 1000000, got 1e+300"),
        ("algorithm.clip_high=1e300", "algorithm.clip_high: expected float <= 10, got 1e+300"),
        ("algorithm.kl_coef=1e300", "algorithm.kl_coef: expected float <= 100, got 1e+300"),
        ("rollout.threads=100000", "rollout.threads: expected int <= 4096, got 100000"),
        (
            f"rollout.max_response_tokens={MAX_TOKENS + 1}",
            f"rollout.max_response_tokens: expected int <= {MAX_TOKENS}, got {MAX_TOKENS + 1}",
        ),
        (
            f"rollout.max_input_tokens={MAX_TOKENS + 1}",
            f"rollout.max_input_tokens: expected int <= {MAX_TOKENS}, got {MAX_TOKENS + 1}",
        ),
        (
            "pipeline.transfer_timeout_s=1e30",
            "pipeline.transfer_timeout_s: expected float <= 604800, got 1e+30",
        ),
        ("model.vocab_pad_multiple=131072", "model.vocab_pad_multiple: expected int <= 65536, got 131072"),
        # the generic int cap (counts that end in C ints)
        (f"rollout.top_k={2**31}", f"rollout.top_k: expected int <= {INT_MAX} (2**31 - 1), got {2**31}"),
        (f"train.steps={2**31}", f"train.steps: expected int <= {INT_MAX} (2**31 - 1), got {2**31}"),
        # items of dict fields
        (
            "algorithm.role_weights={solver: .nan}",
            "algorithm.role_weights.solver: expected a finite float, got nan",
        ),
        (
            "algorithm.role_weights={solver: -1}",
            "algorithm.role_weights.solver: expected float >= 0, got -1.0",
        ),
        (
            f"pipeline.staleness_per_role={{verifier: {2**40}}}",
            f"pipeline.staleness_per_role.verifier: expected int <= {INT_MAX} (2**31 - 1), got {2**40}",
        ),
        # types
        ("train.steps=true", "train.steps: expected int, got True (bool)"),
        ("optimizer.lr=abc", "optimizer.lr: expected float, got 'abc' (str)"),
        ("optimizer.lr=[1e-6]", "optimizer.lr: expected float, got [1e-06] (list)"),
        ("train=5", "train: expected a mapping (section), got 5 (int)"),
        (
            "train.stepz=5",
            "train.stepz: unknown key; valid keys in 'train': steps, pack_length, "
            "updates_per_batch, seed, recompute (did you mean 'train.steps'?)",
        ),
    ],
)
def test_bound_messages(override: str, message: str) -> None:
    assert str(error_of([override])) == f"override {override!r}: {message}"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("lr=2", "lr: expected float <= 1, got 2.0"),
        ("mix_lr=.inf", "mix_lr: expected a finite float, got inf"),
        ("skill_careful=1.5", "skill_careful: expected float <= 1, got 1.5"),
        ("min_lr_ratio=2", "min_lr_ratio: expected float <= 1, got 2.0"),
        ("max_operand=100000", "max_operand: expected int <= 999, got 100000"),
        (f"seed={2**32}", f"seed: expected int <= {SEED_MAX}, got {2**32}"),
        ("demos.input_accuracy=1.1", "demos.input_accuracy: expected float <= 1, got 1.1"),
    ],
)
def test_sft_bound_messages(override: str, message: str) -> None:
    assert str(error_of([override], SFTConfig)) == f"override {override!r}: {message}"


def test_largest_values_in_bounds_are_accepted() -> None:
    cfg = load_config(
        None,
        [
            f"train.seed={SEED_MAX}",
            f"evaluation.seed={2**31 - 1}",
            "optimizer.lr=1",
            "rollout.top_p=1",
            "rollout.temperature=10",
            f"train.pack_length={MAX_TOKENS}",
            f"rollout.max_response_tokens={MAX_TOKENS}",
            f"rollout.top_k={INT_MAX}",
        ],
    )
    assert cfg.train.seed == SEED_MAX and cfg.rollout.top_k == INT_MAX


def test_trainer_seed_bound_is_what_every_consumer_accepts() -> None:
    """SEED_MAX is the intersection measured here: numpy's legacy seeding (vLLM's set_random_seed) stops
    at 2**32 - 1, torch at 2**64 - 1, Python's random takes any int."""
    import random

    import numpy as np
    import torch

    for consume in (
        np.random.seed,
        torch.manual_seed,
        random.seed,
        lambda s: torch.Generator().manual_seed(s),
    ):
        consume(SEED_MAX)
    with pytest.raises(ValueError):
        np.random.seed(SEED_MAX + 1)


def test_examples_are_within_bounds() -> None:
    examples = Path(__file__).resolve().parent.parent / "examples"
    for path in sorted(examples.glob("*.yaml")):
        load_config(path, root=SFTConfig if path.name.endswith("_sft.yaml") else None)


# ------------------------------------------------------------------------------------------ YAML files
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train:\n  steps: 2\n  steps: 3\n", "invalid YAML at line 3, column 3: duplicate key 'steps'"),
        (
            "train:\n  steps: 2\ntrain:\n  seed: 3\n",
            "invalid YAML at line 3, column 1: duplicate key 'train'",
        ),
        ("train: " + "[" * 5000 + "]" * 5000 + "\n", "invalid YAML: nested too deeply"),
        ("train:\n  steps: " + "9" * 5000 + "\n", "invalid YAML: Exceeds the limit (4300 digits)"),
        ("- 1\n- 2\n", "expected a mapping of sections, got list"),
        ("5\n", "expected a mapping of sections, got int"),
        ("train:\n  steps: 2\n   seed: 1\n", "invalid YAML at line 3"),
        ("train: !!python/object:os.system {}\n", "could not determine a constructor"),
        ("train:\n  seed: 2024-01-01\n", "train.seed: expected int, got datetime.date(2024, 1, 1) (date)"),
        ("train:\n  steps: !!binary aGVsbG8=\n", "train.steps: expected int, got b'hello' (bytes)"),
        ("1: 2\n", "1: unknown key; valid keys in the top level"),
        ("optimizer:\n  lr: 1e400\n", "optimizer.lr: expected a finite float, got inf"),
    ],
)
def test_malformed_yaml_is_a_config_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)


def test_merge_keys_may_repeat_and_are_not_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("train:\n  <<: {steps: 3}\n  seed: 5\n", encoding="utf-8")
    cfg = load_config(path)
    assert (cfg.train.steps, cfg.train.seed) == (3, 5)


def test_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_bytes(b"train:\n  steps: 2 # \xe9\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 20 is 0xe9\)"):
        load_config(path)


def test_long_values_are_cut_in_messages() -> None:
    err = error_of(["train.steps=" + "9" * 4000])
    assert len(str(err)) < 400 and "(4000 chars)" in str(err)


def test_unknown_bound_name_is_a_programming_error() -> None:
    with pytest.raises(TypeError, match="unknown bound 'maximum'"):
        _field(1, "help", maximum=3)


def test_describe_shows_bounds_and_the_rules() -> None:
    text = describe_config()
    assert text.startswith("Every float must be finite; every int without a '<=' bound must be <= 2147483647")
    assert "  optimizer.lr: float > 0, <= 1; default 1.0e-06" in text
    assert f"  train.seed: int >= 0, <= {SEED_MAX}; default 1234" in text
    assert "  rollout.gpu_memory_utilization: float or null > 0, <= 1; default null" in text


# ------------------------------------------------------------------------------- sampling parameters
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": float("inf")}, "temperature must be >= 0 and finite, got inf"),
        ({"temperature": float("-inf")}, "temperature must be >= 0 and finite, got -inf"),
        ({"temperature": float("nan")}, "temperature must be >= 0 and finite, got nan"),
        ({"temperature": True}, "temperature must be a number, got True"),
        ({"temperature": "1"}, "temperature must be a number, got '1'"),
        ({"top_p": float("nan")}, "top_p must be in (0, 1], got nan"),
        ({"top_p": float("inf")}, "top_p must be in (0, 1], got inf"),
        ({"max_tokens": True}, "max_tokens must be an int, got True"),
        ({"max_tokens": 1.5}, "max_tokens must be an int, got 1.5"),
        ({"top_k": 2.0}, "top_k must be an int, got 2.0"),
        ({"seed": 2**63}, f"seed must be a 64-bit int or None, got {2**63}"),
        ({"seed": -(2**63) - 1}, f"seed must be a 64-bit int or None, got {-(2**63) - 1}"),
        ({"seed": True}, "seed must be a 64-bit int or None, got True"),
    ],
)
def test_sampling_params_refuse_non_finite_and_mistyped(kwargs: dict[str, Any], message: str) -> None:
    from mars_megatron.rollout.engine import SamplingParams

    with pytest.raises(ValueError) as err:
        SamplingParams(**{"max_tokens": 4, **kwargs})
    assert str(err.value) == message


def test_a_segments_params_check_the_budget_and_seed_they_change() -> None:
    """``with_budget`` (one per segment) keeps the run's checked sampling and checks what it sets."""
    from mars_megatron.rollout.engine import SamplingParams

    run = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=(2,))
    segment = run.with_budget(16, 2**63 - 1)
    assert segment == SamplingParams(16, 0.7, 0.9, 5, seed=2**63 - 1, stop_token_ids=(2,))
    assert run.max_tokens == 64 and run.seed is None  # the run's params are left as they were
    for budget, seed, message in [
        (0, 1, "max_tokens must be an int >= 1, got 0"),
        (True, 1, "max_tokens must be an int >= 1, got True"),
        (4, 2**63, f"seed must be a 64-bit int or None, got {2**63}"),
    ]:
        with pytest.raises(ValueError) as err:
            run.with_budget(budget, seed)
        assert str(err.value) == message


def test_sampling_params_take_numpy_numbers() -> None:
    import numpy as np

    from mars_megatron.rollout.engine import SamplingParams

    params = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.5), seed=np.int64(-(2**63)))
    assert params.max_tokens == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 2**30}, f"--max-tokens: expected int <= {MAX_TOKENS}, got {2**30}"),
        ({"temperature": 11.0}, "--temperature: expected float <= 10, got 11.0"),
        ({"temperature": float("inf")}, "--temperature: expected a finite float, got inf"),
        ({"top_k": 2**40}, f"--top-k: expected int <= {INT_MAX} (2**31 - 1), got {2**40}"),
        ({"top_k": 0}, "--top-k: must be -1 (off) or >= 1, got 0"),
        ({"seed": 2**31}, f"--seed: expected int <= {INT_MAX}, got {2**31}"),
        ({"start_retries": -1}, "--start-retries: expected int >= 0, got -1"),
    ],
)
def test_mars_eval_flags_are_checked_by_the_evaluation_section(kwargs: dict[str, Any], message: str) -> None:
    """``mars eval``'s sampling and loop flags are overrides of the ``evaluation`` section: the config's
    bounds refuse them, and the error names the flag typed."""
    import argparse

    from mars_megatron.evaluation.command import OPTIONS, evaluation_section

    args = argparse.Namespace(**{name: kwargs.get(name) for name in OPTIONS})
    with pytest.raises(ValueError) as err:
        evaluation_section(args, None)
    assert str(err.value) == message


def test_evaluation_section_fits_the_engines_sampling() -> None:
    """The largest evaluation.* values the config accepts build the engine sampling parameters of held-out
    evaluation (they failed there, mid-run, when the config was looser: evaluation.top_p=2,
    evaluation.seed=2**31); a null max_tokens is the rollout's response budget."""
    from mars_megatron.evaluation import sampling
    from mars_megatron.rl.evaluate import settings

    cfg = load_config(
        None,
        [
            "evaluation.top_p=1",
            "evaluation.temperature=10",
            f"evaluation.seed={2**31 - 1}",
            "rollout.max_response_tokens=7",
        ],
    )
    params = sampling.params(settings(cfg), cfg.evaluation.seed)
    assert (params.max_tokens, params.top_p, params.temperature, params.seed) == (7, 1.0, 10.0, 2**31 - 1)
