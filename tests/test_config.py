"""Tests for mars_megatron.config: YAML + overrides loading, type/bound/cross-field errors, layouts."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from mars_megatron.config import (
    ConfigError,
    MarsConfig,
    OptimizerConfig,
    ParallelConfig,
    config_to_dict,
    describe_config,
    dump_config,
    load_config,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# *_sft.yaml files are `mars sft` configs (root SFTConfig), tested below
EXAMPLE_FILES = sorted(p for p in EXAMPLES.glob("*.yaml") if not p.name.endswith("_sft.yaml"))


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def error_of(path: str | Path | None, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


# --- defaults and examples ---------------------------------------------------------------------------


def test_defaults() -> None:
    cfg = load_config(None)
    assert cfg == MarsConfig()
    assert (cfg.model.hf_dir, cfg.model.dtype, cfg.model.transformer_impl) == (None, "float32", "auto")
    assert (cfg.model.vocab_pad_multiple, cfg.model.fp8) == (128, None)
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.etp) == (1, 1, 1, None)
    assert cfg.parallel.effective_etp == 1
    assert cfg.parallel.sequence_parallel is None and cfg.parallel.effective_sequence_parallel is False
    assert cfg.parallel.moe_token_dispatcher == "allgather" and cfg.parallel.use_distributed_optimizer
    assert cfg.optimizer == OptimizerConfig(1e-6, 0.0, 0.9, 0.999, 1e-8, 1.0)
    assert cfg.logging.run_dir == "runs/default"
    assert cfg.checkpoint.save_dir is None and cfg.checkpoint.save_interval == 0


def test_empty_file_and_empty_section_give_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == MarsConfig()
    assert load_config(write(tmp_path, "checkpoint:\nparallel:\n  tp: 2\n")).checkpoint.keep_last == 2


def test_example_files_present() -> None:
    names = {path.name for path in EXAMPLE_FILES}
    assert {"tiny_cpu.yaml", "qwen3_30b_a3b.yaml", "qwen3_235b_a22b.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_every_example_loads(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, MarsConfig)
    raw = yaml.safe_load(path.read_text())
    assert cfg.train.steps == raw["train"]["steps"]  # the file was really read, not defaults


def test_sft_example_loads_as_an_sft_config() -> None:
    from mars_megatron.tasks.sft import SFTConfig

    sft = load_config(EXAMPLES / "tiny_sft.yaml", root=SFTConfig)
    assert isinstance(sft, SFTConfig)
    assert sft.prompts == load_config(EXAMPLES / "tiny_cpu.yaml").agents.prompts
    with pytest.raises(ConfigError, match="stepz: unknown key"):
        load_config(EXAMPLES / "tiny_sft.yaml", ["stepz=3"], root=SFTConfig)


def test_example_layouts() -> None:
    tiny = load_config(EXAMPLES / "tiny_cpu.yaml")
    assert (tiny.agents.prompts, tiny.rollout.engine, tiny.algorithm.reward) == ("compact", "hf", "agent")
    assert tiny.model.hf_dir is None and tiny.check_world_size(2) == 2
    assert (EXAMPLES.parent / tiny.data.train_file).is_file()
    q30 = load_config(EXAMPLES / "qwen3_30b_a3b.yaml")
    p30 = q30.parallel
    assert (p30.tp, p30.pp, p30.cp, p30.ep, p30.etp) == (4, 2, 4, 8, 1)
    assert (q30.model.dtype, q30.model.transformer_impl) == ("bfloat16", "transformer_engine")
    assert (q30.data.problems_per_step, q30.agents.group_size, q30.optimizer.lr) == (128, 8, 1e-6)
    assert (q30.rollout.max_response_tokens, q30.train.pack_length) == (65536, 98304)
    assert q30.parallel.moe_token_dispatcher == "alltoall" and q30.check_world_size(32) == 1
    q235 = load_config(EXAMPLES / "qwen3_235b_a22b.yaml")
    assert (q235.parallel.tp, q235.parallel.pp, q235.parallel.cp, q235.parallel.ep) == (2, 8, 8, 8)
    assert q235.check_world_size(128) == 1
    # the paper's schedule, disaggregated vLLM engines
    for cfg, rollout_tp, recompute in ((q30, 4, "none"), (q235, 8, "full")):
        p = cfg.pipeline
        assert (p.mode, p.segment_tokens, p.max_staleness) == ("agentic", 16384, 1)
        assert p.placement == "disaggregated"
        assert (cfg.rollout.engine, cfg.rollout.tp, cfg.rollout.temperature) == ("vllm", rollout_tp, 0.85)
        assert (cfg.train.recompute, cfg.model.fp8) == (recompute, None)
        assert cfg.rollout.max_input_tokens + cfg.rollout.max_response_tokens == cfg.train.pack_length


# --- overrides -----------------------------------------------------------------------------------------


def test_overrides_of_each_type() -> None:
    cfg = load_config(
        EXAMPLES / "tiny_cpu.yaml",
        [
            "parallel.tp=2",
            "model.hf_dir=/ckpt/a=b",
            "model.fp8=hybrid",
            "model.transformer_impl=auto",
            "model.fp8=null",
            "train.seed=3",
            "logging.tensorboard=true",
            "optimizer.lr=3e-5",
            "optimizer.clip_grad=2",
            "parallel.sequence_parallel=null",
        ],
    )
    assert (cfg.parallel.tp, cfg.model.hf_dir, cfg.model.fp8, cfg.train.seed) == (2, "/ckpt/a=b", None, 3)
    assert cfg.logging.tensorboard is True
    assert cfg.optimizer.lr == 3e-5 and type(cfg.optimizer.lr) is float  # 3e-5 without a dot is a float
    assert cfg.optimizer.clip_grad == 2.0 and type(cfg.optimizer.clip_grad) is float  # ints widen
    assert cfg.parallel.effective_sequence_parallel is True  # null = auto, on because tp > 1
    assert cfg.train.steps == load_config(EXAMPLES / "tiny_cpu.yaml").train.steps  # untouched file value


def test_override_section_mapping_merges_and_last_wins() -> None:
    cfg = load_config(EXAMPLES / "qwen3_30b_a3b.yaml", ["parallel={tp: 4, ep: 4}", "parallel.ep=2"])
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep) == (4, 2, 2)
    assert cfg.parallel.moe_token_dispatcher == "alltoall"  # kept from the file


def test_overrides_without_file() -> None:
    assert load_config(None, ["train.steps=7"]).train.steps == 7


@pytest.mark.parametrize("bad", ["parallel.tp", "parallel..tp=2", "=2", ".tp=1"])
def test_malformed_override(bad: str) -> None:
    assert f"malformed override {bad!r}: expected dotted.key=value" in error_of(None, (bad,))


def test_override_bad_yaml_value() -> None:
    message = error_of(None, ("train.steps=[1,",))
    assert message.startswith("override 'train.steps=[1,': train.steps: invalid YAML")


def test_overrides_must_not_be_one_string() -> None:
    with pytest.raises(TypeError, match="sequence of 'key=value' strings"):
        load_config(None, "parallel.tp=2")  # type: ignore[arg-type]


# --- unknown keys ---------------------------------------------------------------------------------------


def test_nested_unknown_key_in_file(tmp_path: Path) -> None:
    path = write(tmp_path, "parallel:\n  tpp: 2\n")
    assert error_of(path) == (
        f"{path}: parallel.tpp: unknown key; valid keys in 'parallel': tp, pp, cp, ep, etp, "
        "sequence_parallel, moe_token_dispatcher, use_distributed_optimizer, first_stage_layers, "
        "last_stage_layers (did you mean 'parallel.tp'?)"
    )


def test_unknown_top_level_key(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, "paralel:\n  tp: 2\n"))
    assert "paralel: unknown key; valid keys in the top level: model, parallel, optimizer," in message
    assert "(did you mean 'parallel'?)" in message


def test_unknown_key_in_override_names_the_override() -> None:
    message = error_of(EXAMPLES / "tiny_cpu.yaml", ("logging.tensorbord=true",))
    assert message.startswith("override 'logging.tensorbord=true': logging.tensorbord: unknown key")
    assert "did you mean 'logging.tensorboard'?" in message and "tiny_cpu.yaml" not in message


def test_unknown_key_without_close_match() -> None:
    message = error_of(None, ("train.zzzzzz=1",))
    assert "train.zzzzzz: unknown key; valid keys in 'train': steps, pack_length" in message
    assert "did you mean" not in message


def test_override_into_a_leaf_names_the_override() -> None:
    message = error_of(EXAMPLES / "tiny_cpu.yaml", ("train.steps.x=1",))
    assert message == "override 'train.steps.x=1': train.steps: expected int, got {'x': 1} (dict)"


# --- types, bounds, choices -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("parallel:\n  tp: true\n", "parallel.tp: expected int, got True (bool)"),
        ('train:\n  steps: "2"\n', "train.steps: expected int, got '2' (str)"),
        ("train:\n  steps: 2.0\n", "train.steps: expected int, got 2.0 (float)"),
        ("train:\n  steps: null\n", "train.steps: expected int, got None (NoneType)"),
        ("optimizer:\n  lr: [1]\n", "optimizer.lr: expected float, got [1] (list)"),
        ('optimizer:\n  lr: "1e-6"\n', "optimizer.lr: expected float, got '1e-6' (str)"),
        ("logging:\n  tensorboard: 1\n", "logging.tensorboard: expected bool, got 1 (int)"),
        ("model:\n  hf_dir: 5\n", "model.hf_dir: expected str or null, got 5 (int)"),
        ("parallel:\n  etp: false\n", "parallel.etp: expected int or null, got False (bool)"),
        ("parallel: 4\n", "parallel: expected a mapping (section), got 4 (int)"),
    ],
)
def test_wrong_types_name_the_field(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    assert error_of(path) == f"{path}: {expected}"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("parallel.tp=0", "parallel.tp: expected a positive int, got 0"),
        ("parallel.etp=0", "parallel.etp: expected a positive int, got 0"),
        ("rollout.tp=0", "rollout.tp: expected a positive int, got 0"),
        ("train.pack_length=1", "train.pack_length: expected int >= 2, got 1"),
        ("checkpoint.save_interval=-1", "checkpoint.save_interval: expected int >= 0, got -1"),
        ("optimizer.lr=0", "optimizer.lr: expected float > 0, got 0.0"),
        ("optimizer.adam_beta2=1", "optimizer.adam_beta2: expected float < 1, got 1.0"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay: expected float >= 0, got -0.1"),
        ("optimizer.lr=.nan", "optimizer.lr: expected a finite float, got nan"),
        ("algorithm.mismatch_threshold=1", "algorithm.mismatch_threshold: expected float > 1, got 1.0"),
        ("moe.routing_replay=R1", "moe.routing_replay: expected one of 'off', 'R2', 'R3', got 'R1' (str)"),
    ],
)
def test_bounds(override: str, expected: str) -> None:
    assert error_of(None, (override,)) == f"override {override!r}: {expected}"


def test_literal_choices() -> None:
    assert load_config(None, ["model.dtype=bfloat16"]).model.dtype == "bfloat16"
    # YAML reads a bare `off` as false: where 'off' is a choice, it means 'off'
    assert load_config(None, ["moe.routing_replay=off"]).moe.routing_replay == "off"
    assert "got True (bool)" in error_of(None, ("moe.routing_replay=on",))
    message = error_of(None, ("model.dtype=bf16",))
    assert message.endswith("model.dtype: expected one of 'float32', 'bfloat16', 'float16', got 'bf16' (str)")
    message = error_of(None, ("model.fp8=e5m2",))
    assert message.endswith(
        "model.fp8: expected one of 'hybrid', 'e4m3', 'blockwise' or null, got 'e5m2' (str)"
    )
    message = error_of(None, ("parallel.moe_token_dispatcher=flex",))
    assert "parallel.moe_token_dispatcher: expected one of 'allgather', 'alltoall'" in message


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"^tp: expected a positive int, got 0$"):
        ParallelConfig(tp=0)
    assert type(OptimizerConfig(lr=1).lr) is float
    with pytest.raises(ConfigError, match=r"^parallel\.tp: expected int, got '2' \(str\)$"):
        MarsConfig(parallel={"tp": "2"})  # type: ignore[arg-type]


# --- files ----------------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert error_of(path) == f"{path}: config file not found"


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  dtype: float32\nparallel:\n  tp: [1, 2\n  pp: 1\n", "broken.yaml")
    message = error_of(path)
    assert message.startswith(f"{path}: invalid YAML at line 5, column 5:")
    assert "broken.yaml" in message


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "- 1\n- 2\n")
    assert error_of(path) == f"{path}: expected a mapping of sections, got list"


def test_file_error_names_file_even_with_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  steps: 0\n")
    assert error_of(path, ("parallel.tp=2",)) == f"{path}: train.steps: expected a positive int, got 0"


# --- cross-field checks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["train.pack_length=1000", "rollout.max_response_tokens=1001"],
            "train.pack_length: 1000 is shorter than rollout.max_response_tokens (1001)",
        ),
        (["rollout.top_k=0"], "rollout.top_k: must be -1 (off) or >= 1, got 0"),
        (["model.transformer_impl=local", "model.fp8=e4m3"], "model.fp8: 'e4m3' needs Transformer Engine"),
        (
            ["parallel.tp=2", "train.pack_length=98306", "model.fp8=hybrid"],
            "98306 gives 49153 tokens per micro-batch and rank; model.fp8 needs a multiple of 16",
        ),
        (["parallel.sequence_parallel=true"], "parallel.sequence_parallel: true requires tp > 1"),
        (
            ["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=false"],
            "parallel.sequence_parallel: must be on when tp > 1 and ep > 1",
        ),
        (["parallel.tp=3"], "model.vocab_pad_multiple: 128 is not divisible by parallel.tp = 3"),
        (
            ["parallel.tp=2", "train.pack_length=98305"],
            "train.pack_length: 98305 is not divisible by parallel.tp = 2",
        ),
        (["checkpoint.save_interval=10"], "checkpoint.save_interval: is 10 but save_dir is null"),
        (["rollout.tp=2"], "rollout.tp: 2 needs engine 'vllm'"),
    ],
)
def test_cross_field_checks(overrides: list[str], expected: str) -> None:
    assert expected in error_of(None, tuple(overrides))


def test_cross_field_checks_pass_when_consistent() -> None:
    cfg = load_config(None, ["parallel.tp=2", "train.pack_length=98304", "model.fp8=e4m3"])
    assert cfg.parallel.effective_sequence_parallel and cfg.model.fp8 == "e4m3"
    # SP off (allowed with ep 1): the pack length need not split over tp
    cfg = load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=false", "train.pack_length=98305"])
    assert cfg.parallel.effective_sequence_parallel is False and cfg.train.pack_length == 98305
    # multi-GPU engines: vLLM, one worker per GPU bundle, shared with trainer ranks or not
    for placement in ("disaggregated", "none", "colocated"):
        cfg = load_config(None, ["rollout.engine=vllm", "rollout.tp=4", f"pipeline.placement={placement}"])
        assert cfg.rollout.tp == 4


# --- world size -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "world", "dp"),
    [
        ({}, 1, 1),
        ({"tp": 2, "pp": 2}, 8, 2),  # 8 / (2*2)
        ({"ep": 4}, 8, 8),  # tp*dp = 8, 8 % (1*4) == 0
        ({"pp": 2, "ep": 4}, 8, 4),  # dp = 4, tp*dp = 4 % 4 == 0
        ({"tp": 2, "ep": 8, "etp": 1}, 8, 4),  # dp = 4, tp*dp = 8 % (etp 1 * ep 8) == 0
        ({"tp": 2, "ep": 4, "etp": None}, 8, 4),  # etp = tp = 2: tp*dp = 8 % (2*4) == 0
        ({"tp": 4, "pp": 8, "ep": 8, "etp": 1}, 64, 2),  # tp*dp = 8 % 8 == 0
    ],
)
def test_valid_world_sizes(layout: dict[str, int | None], world: int, dp: int) -> None:
    assert ParallelConfig(**layout).check_world_size(world) == dp


@pytest.mark.parametrize(
    ("layout", "world", "expected"),
    [
        ({"tp": 2, "pp": 2}, 6, "world size 6 is not divisible by tp*cp*pp = 2*1*2 = 4"),
        (
            {"tp": 4, "pp": 8, "ep": 8, "etp": 1},
            32,
            "tp*cp*dp = 4*1*1 = 4 ranks per pipeline stage, not divisible by etp*ep = 1*8 = 8",
        ),
        (
            {"pp": 2, "ep": 4},
            4,
            "tp*cp*dp = 1*1*2 = 2 ranks per pipeline stage, not divisible by etp*ep = 1*4 = 4",
        ),
        (
            {"tp": 2, "ep": 4, "etp": None},
            4,
            "tp*cp*dp = 2*1*2 = 4 ranks per pipeline stage, not divisible by etp*ep = 2*4 = 8",
        ),
        ({}, 0, "world size must be a positive int, got 0"),
        ({}, True, "world size must be a positive int, got True"),
    ],
)
def test_invalid_world_sizes(layout: dict[str, int | None], world: int, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**layout).check_world_size(world)
    assert expected in str(info.value)


def test_etp_changes_the_expert_rule() -> None:
    assert ParallelConfig(tp=2, ep=4, etp=1).check_world_size(4) == 2  # tp*dp = 4 % (1*4) == 0
    with pytest.raises(ConfigError):
        ParallelConfig(tp=2, ep=4, etp=None).check_world_size(4)  # 4 % (2*4) != 0


def test_root_world_size_prefixes_parallel() -> None:
    cfg = load_config(EXAMPLES / "tiny_cpu.yaml")  # ep 2
    assert cfg.check_world_size(2) == 2 and cfg.check_world_size(4) == 4
    with pytest.raises(ConfigError) as info:
        cfg.check_world_size(3)
    assert str(info.value).startswith(
        "parallel: world size 3 gives tp*cp*dp = 1*1*3 = 3 ranks per pipeline stage"
    )
    with pytest.raises(ConfigError) as info:
        load_config(None, ["parallel.tp=2"]).check_world_size(3)
    assert str(info.value).startswith("parallel: world size 3 is not divisible by tp*cp*pp = 2*1*1 = 2")


# --- dump / describe ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_dump_load_round_trip(tmp_path: Path, path: Path) -> None:
    cfg = load_config(path, ["optimizer.lr=2e-6", "model.fp8=null", "parallel.etp=null"])
    out = dump_config(cfg, tmp_path / "sub" / "resolved.yaml")
    assert "lr: 2.0e-06" in out.read_text()
    again = load_config(out)
    assert again == cfg and again.parallel.etp is None
    assert config_to_dict(again) == config_to_dict(cfg)


def test_config_to_dict_is_plain() -> None:
    data = config_to_dict(load_config(None, ["parallel.tp=2"]))
    assert list(data) == [
        "model", "parallel", "optimizer", "train", "data", "agents", "rollout", "algorithm", "pipeline",
        "moe", "checkpoint", "evaluation", "logging",
    ]  # fmt: skip
    assert data["parallel"]["tp"] == 2 and data["optimizer"]["lr"] == 1e-6
    assert yaml.safe_load(yaml.safe_dump(data)) == data


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "pipeline.staleness_per_role={verifier: -1}",
            "pipeline.staleness_per_role: verifier: expected an int >= 0",
        ),
        ("pipeline.mode=eager", "pipeline.mode"),
        ("pipeline.placement=spread", "pipeline.placement"),
    ],
)
def test_pipeline_section_names_the_bad_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_describe_config_lists_every_field() -> None:
    text = describe_config()
    assert "  parallel.tp: int >= 1; default 1\n      Tensor-parallel size" in text
    assert "  model.fp8: one of 'hybrid', 'e4m3', 'blockwise' or null; default null" in text
    assert "  optimizer.adam_beta1: float >= 0, < 1; default 0.9" in text
    assert "[train] " in text

    def check(
        section: type, prefix: str
    ) -> None:  # nested sections (logging.wandb) get a header of their own
        for leaf in dataclasses.fields(section):  # type: ignore[arg-type]
            if dataclasses.is_dataclass(leaf.type):
                assert f"[{prefix}.{leaf.name}] " in text
                check(leaf.type, f"{prefix}.{leaf.name}")  # type: ignore[arg-type]
                continue
            assert f"  {prefix}.{leaf.name}: " in text
            assert leaf.metadata["help"].split()[0] in text

    for section in dataclasses.fields(MarsConfig):
        check(section.type, section.name)  # type: ignore[arg-type]
    assert "  logging.wandb.mode: one of 'offline', 'online'; default offline" in text


def test_ep1_requires_etp_equal_tp() -> None:
    # Measured: with ep = 1 megatron reduces expert grads like dense ones, so etp < tp loses gradient.
    assert ParallelConfig(tp=2).effective_etp == 2
    with pytest.raises(ConfigError, match=r"etp: must equal tp \(2\) when ep = 1, got 1"):
        ParallelConfig(tp=2, etp=1)
    assert ParallelConfig(tp=2, ep=2, etp=1).effective_etp == 1


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("agents.max_steps=6", "agents.max_steps: is 6, beyond the 5 positions of graph 'marsrl'"),
        (
            "algorithm.role_weights={solvr: 1.0}",
            "algorithm.role_weights.solvr: graph 'marsrl' has no role 'solvr'",
        ),
        (
            "pipeline.staleness_per_role={judge: 1}",
            "pipeline.staleness_per_role.judge: graph 'marsrl' has no role",
        ),
    ],
)
def test_role_keyed_settings_are_checked_against_the_agent_graph(override: str, message: str) -> None:
    """The config cannot know the roles (they are the graph's); ``graph_for`` checks them before a run."""
    from mars_megatron.agents.graph import GraphError
    from mars_megatron.agents.graph_file import graph_for

    cfg = load_config(None, [override])
    with pytest.raises(GraphError) as error:
        graph_for(cfg)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("name", ["eth0; reboot", "$(id)", "ib0,eth0", "a" * 16, "", "^docker"])
def test_a_network_interface_is_one_name_and_nothing_else(name: str) -> None:
    """It reaches the launcher's Slurm script and every rank's environment: one interface name only."""
    said = error_of(None, (f"pipeline.network_interface={name!r}",))
    assert "pipeline.network_interface: " in said and "expected one interface name" in said
    assert load_config(None, ["pipeline.network_interface=ib0"]).pipeline.network_interface == "ib0"
