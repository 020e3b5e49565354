"""``mars eval``: pass@k by hand, the runner on a scripted engine, and the real CLI end to end on the tiny
MoE model (gibberish outputs, so accuracies are ~0: these tests check mechanics, not accuracy)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mars_megatron.agents.graph_file import load_graph
from mars_megatron.config import EvalConfig
from mars_megatron.evaluation import sampling
from mars_megatron.evaluation.data import Problem, load_problems
from mars_megatron.evaluation.metrics import k_values, pass_at_k
from mars_megatron.evaluation.runner import EngineFailure, EvalRunner, step_seed
from mars_megatron.rewards.answers import extract_boxed
from mars_megatron.rewards.checker import CheckResult
from mars_megatron.rollout.chat import PromptTooLongError
from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parents[1] / "examples" / "data"
AIME = DATA / "aime2025.jsonl"
STEP_FIELDS = {
    "role",
    "text",
    "truncated",
    "verdict",
    "solution",
    "prompt_tokens",
    "output_tokens",
    "seed",
    "finish_reason",
}
RECORD_FIELDS = {
    "problem_id", "sample", "line", "reference", "steps", "final_solution", "final_answer", "accepted",
    "stop_reason", "correct_votes", "system_correct", "system_check", "solver_answer", "solver_correct",
    "solver_check", "solutions_correct",
}  # fmt: skip


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [(2, 1, 1, 0.5), (2, 1, 2, 1.0), (4, 1, 2, 0.5), (4, 2, 2, 5 / 6), (5, 0, 3, 0.0), (3, 3, 1, 1.0)],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    # (4, 1, 2): 1 - C(3,2)/C(4,2) = 1 - 3/6; (4, 2, 2): 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_k_values_and_bad_pass_at_k():
    assert k_values(1) == [1] and k_values(6) == [1, 2, 4, 6] and k_values(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_bad_data_lines_are_counted_with_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"query": "1+1?", "ans_box": "2", "qid": 7}\n'
        "{not json\n"
        '{"query": "no answer"}\n'
        "\n"
        '{"ans_box": 3}\n'
        '{"input": "2+1?", "ans_box": 3}\n'
        '{"query": "dup", "ans_box": 1, "qid": 7}\n'
    )
    with pytest.warns(UserWarning) as caught:
        data = load_problems(path)
    assert len(caught) == 4 and f"{path}:2: invalid JSON" in str(caught[0].message)
    assert [(p.problem_id, p.text, p.reference, p.line) for p in data.problems] == [
        ("7", "1+1?", "2", 1),
        ("line6", "2+1?", 3, 6),
    ]
    assert [s.split(": ")[0].rsplit(":", 1)[1] for s in data.skipped] == ["2", "3", "5", "7"]


# ---------------------------------------------------------------- runner on a scripted engine

TEXTS = {
    1: "so \\boxed{4}",
    2: "**Correctness**: Correct",
    3: "**Correctness**: Wrong",
    4: "fixed \\boxed{5}",
    5: "Log: step 1 recomputed.",
    6: "Yes.",
    7: "No.",
}


class ScriptedCodec:
    """Prompt ids: one id per message; output ids decode to the canned texts above."""

    def __init__(self, too_long_role: str | None = None):
        self.too_long_role = too_long_role

    def encode(self, messages):
        if self.too_long_role == "verifier" and messages[0]["role"] == "system":
            raise PromptTooLongError(40000, 32768)
        return tuple(range(1, len(messages) + 1))

    def decode(self, ids):
        return "".join(TEXTS[i] for i in ids)


class ScriptedEngine:
    """Solver answers 4; the Verifier says Wrong on its first call for sample 1, else Correct."""

    def __init__(self, fail_on_call: int | None = None):
        self.batches: list[list[str]] = []
        self.fail_on_call = fail_on_call

    def generate(self, requests):
        if self.fail_on_call == len(self.batches):
            raise ConnectionError("endpoint went away")
        self.batches.append([r.request_id for r in requests])
        outputs = []
        for r in requests:
            _pid, sample, step, role = r.request_id.split("/")
            ids = {"solver": [1], "corrector": [4]}.get(role, [3] if (sample, step) == ("1", "1") else [2])
            outputs.append(GenerationOutput(r.request_id, ids, [0.0] * len(ids), "stop"))
        return outputs


class ExactChecker:
    def check_many(self, pairs):
        return [CheckResult(extract_boxed(text) == str(ref), "ok") for text, ref in pairs]


PROBLEMS = [Problem("a", "2+2?", "4", 1), Problem("b", "2+3?", 5, 2)]
MARSRL = load_graph("marsrl")
ROLES = list(MARSRL.roles)


def run_scripted(engine, codec=None, **kwargs):
    records = []
    runner = EvalRunner(
        engine, codec or ScriptedCodec(), ExactChecker(), on_result=records.append, graph=MARSRL,
        config=EvalConfig(accept_after=2, give_up_after=2, max_tokens=8), **kwargs,
    )  # fmt: skip
    jobs = [(p, s) for p in PROBLEMS for s in range(2)]
    return runner, records, jobs


def test_runner_batches_every_loop_per_round_and_records_each_step():
    engine = ScriptedEngine()
    runner, records, jobs = run_scripted(engine)
    assert runner.run(jobs) == 4
    # one generate call per round, carrying every active loop's request
    assert [len(b) for b in engine.batches] == [4, 4, 4, 2, 2]
    by_key = {(r["problem_id"], r["sample"]): r for r in records}
    assert set(by_key) == {("a", 0), ("a", 1), ("b", 0), ("b", 1)}
    plain, corrected = by_key[("a", 0)], by_key[("b", 1)]
    assert [s["role"] for s in plain["steps"]] == ["solver", "verifier", "verifier"]
    assert [s["verdict"] for s in plain["steps"]] == [None, True, True]
    assert plain["accepted"] and plain["system_correct"] and plain["solver_correct"]
    assert [s["role"] for s in corrected["steps"]] == [
        "solver",
        "verifier",
        "corrector",
        "verifier",
        "verifier",
    ]
    # problem b's reference is 5: the Solver's 4 is wrong, the accepted correction is right
    assert (
        corrected["final_answer"] == "5" and corrected["system_correct"] and not corrected["solver_correct"]
    )
    assert by_key[("b", 0)]["system_correct"] is False and by_key[("b", 0)]["stop_reason"] == "accepted"
    # every solution is checked, and each step names the solution it made (Solver, Corrector) or judged
    assert corrected["solutions_correct"] == [False, True]
    assert [s["solution"] for s in corrected["steps"]] == [0, 0, 1, 1, 1]
    assert all(set(r) == RECORD_FIELDS and all(STEP_FIELDS <= set(s) for s in r["steps"]) for r in records)
    assert plain["steps"][0]["seed"] == step_seed(0, "a", 0, 0) != step_seed(0, "a", 1, 0)
    assert plain["steps"][0]["prompt_tokens"] == 1 and plain["steps"][1]["prompt_tokens"] == 2


class RoleEngine(ScriptedEngine):
    """A ScriptedEngine that records the roles it was asked to answer."""

    def __init__(self) -> None:
        super().__init__()
        self.roles: set[str] = set()

    def generate(self, requests):
        self.roles |= {r.request_id.rsplit("/", 1)[1] for r in requests}
        return super().generate(requests)


def test_each_role_is_answered_by_its_own_engine_and_codec() -> None:
    """algorithm.policies=per_role: every request goes to its role's engine (one call per engine and
    round), outputs are decoded by that role's codec, and the results equal a single engine's."""
    engines = {role: RoleEngine() for role in ROLES}
    codecs = {role: ScriptedCodec() for role in ROLES}
    runner, records, jobs = run_scripted(engines, codec=codecs)
    assert runner.run(jobs) == 4
    assert {role: e.roles for role, e in engines.items()} == {r: {r} for r in ROLES}
    single, reference, _ = run_scripted(ScriptedEngine())
    single.run(jobs)

    def key(r: dict) -> tuple:
        return r["problem_id"], r["sample"]

    assert sorted(records, key=key) == sorted(reference, key=key)
    with pytest.raises(ValueError, match="no engine or codec for role"):
        EvalRunner({"solver": ScriptedEngine()}, ScriptedCodec(), ExactChecker(), graph=MARSRL)


def test_the_loop_speaks_the_prompt_set_it_is_given() -> None:
    """A model trained on the compact prompts is evaluated with them: every role's messages come from the
    set given to the runner, not from the marsrl texts."""

    class Recording(ScriptedCodec):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list = []

        def encode(self, messages):
            self.seen.append(messages)
            return super().encode(messages)

    codec = Recording()
    runner, _, jobs = run_scripted(ScriptedEngine(), codec=codec, prompts="compact")
    runner.run(jobs)
    assert codec.seen[0] == [{"role": "user", "content": "2+2?\n\nAnswer in \\boxed{}."}]
    verifier = next(m for m in codec.seen if "Correctness: Correct or Wrong" in m[-1]["content"])
    assert verifier[0]["role"] == "user"  # compact has no system message; marsrl's Verifier has one
    assert not any("meticulous reviewer" in m["content"] for msgs in codec.seen for m in msgs)


def test_role_accuracy_scores_each_verdict_against_what_it_judged() -> None:
    from mars_megatron.evaluation.metrics import role_accuracy

    def step(role, solution, verdict=None):
        return {"role": role, "solution": solution, "verdict": verdict}

    records = [
        {  # wrong solution: rejected (right), corrected to a right one, accepted (right)
            "solutions_correct": [False, True],
            "steps": [
                step("solver", 0),
                step("verifier", 0, False),
                step("corrector", 1),
                step("verifier", 1, True),
            ],
        },
        {  # right solution: rejected (wrong), the correction breaks it, accepted anyway (wrong)
            "solutions_correct": [True, False],
            "steps": [
                step("solver", 0),
                step("verifier", 0, None),
                step("corrector", 1),
                step("verifier", 1, True),
            ],
        },
        {  # a dropped (truncated) correction of a wrong solution fixes nothing
            "solutions_correct": [False],
            "steps": [step("solver", 0), step("verifier", 0, False), step("corrector", None)],
        },
        {"steps": []},  # a line from before solutions were checked: left out
    ]
    got = role_accuracy(records, MARSRL)
    assert got["verifier"] == {
        "acc_on_right": 1 / 2, "acc_on_wrong": 2 / 3, "calls_on_right": 2, "calls_on_wrong": 3,
    }  # fmt: skip
    assert got["corrector"] == {
        "fix_rate": 1 / 2,
        "break_rate": 1.0,
        "calls_on_wrong": 2,
        "calls_on_right": 1,
    }


MARSRL_SUMMARY_KEYS = [
    "problems", "samples", "results", "missing_results", "solver_acc", "system_acc", "pass@k",
    "accepted_rate", "roles", "stop_reasons", "tokens", "prompts_too_long", "checker",
]  # fmt: skip
MARSRL_EVAL_KEYS = [
    "eval/solver_acc", "eval/system_acc", "eval/solver_pass@2", "eval/system_pass@2", "eval/accepted_rate",
    "eval/verifier_acc_on_right", "eval/verifier_acc_on_wrong", "eval/corrector_fix_rate", "eval/time",
]  # fmt: skip
"""The names MarsRL's evaluation persisted before agent graphs (summary.json, eval.jsonl): unchanged."""


def test_marsrl_summary_and_curve_names_are_unchanged() -> None:
    from mars_megatron.evaluation.metrics import summarize
    from mars_megatron.rl.evaluate import eval_metrics

    runner, records, jobs = run_scripted(ScriptedEngine())
    runner.run(jobs)
    summary = summarize(records, ["a", "b"], 2, MARSRL)
    assert list(summary) == MARSRL_SUMMARY_KEYS
    assert list(summary["pass@k"]) == ["solver", "system"] and list(summary["roles"]) == [
        "verifier",
        "corrector",
    ]
    assert list(summary["tokens"]) == ["solver", "verifier", "corrector"]
    # a0 accepted right; a1 rejected its right 4, the correction broke it; b0 accepted a wrong 4; b1 fixed
    assert summary["solver_acc"] == 0.5 and summary["system_acc"] == 0.5
    assert summary["roles"]["verifier"] == {
        "acc_on_right": 4 / 5, "acc_on_wrong": 1 / 5, "calls_on_right": 5, "calls_on_wrong": 5,
    }  # fmt: skip
    assert summary["roles"]["corrector"] == {
        "fix_rate": 1.0, "break_rate": 1.0, "calls_on_wrong": 1, "calls_on_right": 1,
    }  # fmt: skip
    metrics = eval_metrics(summary, 1.5, MARSRL)
    assert list(metrics) == MARSRL_EVAL_KEYS and metrics["eval/verifier_acc_on_right"] == 4 / 5


class ImoEngine:
    """The IMO pipeline on scripted outputs: the Solver answers 4, the Verifier writes a log, the Judge says
    no on its first call for sample 1 (then the Corrector answers 5), else yes."""

    def generate(self, requests):
        outputs = []
        for r in requests:
            _pid, sample, step, role = r.request_id.split("/")
            ids = {"solver": [1], "verifier": [5], "corrector": [4]}.get(role)
            if ids is None:
                ids = [7] if (sample, step) == ("1", "2") else [6]
            outputs.append(GenerationOutput(r.request_id, ids, [0.0] * len(ids), "stop"))
        return outputs


def test_the_imo_pipeline_runs_and_is_scored_by_role_kind() -> None:
    """Any graph's loop runs: the Judge's yes/no decides, the Verifier's log is reported on (no verdict
    of its own, so no accuracy), the Corrector is scored by its fix rate, and the curve is named after
    the graph's roles."""
    from mars_megatron.evaluation.metrics import summarize
    from mars_megatron.rl.evaluate import eval_metrics

    imo = load_graph("imo_refine")
    records: list[dict] = []
    config = EvalConfig(accept_after=2, give_up_after=2, max_tokens=8)
    runner = EvalRunner(ImoEngine(), ScriptedCodec(), ExactChecker(), graph=imo, config=config,
                        prompts="compact", on_result=records.append)  # fmt: skip
    assert runner.run([(p, s) for p in PROBLEMS for s in range(2)]) == 4
    by_key = {(r["problem_id"], r["sample"]): r for r in records}
    corrected = by_key[("b", 1)]
    assert [s["role"] for s in corrected["steps"]] == [
        "solver", "verifier", "judge", "corrector", "verifier", "judge", "verifier", "judge",
    ]  # fmt: skip
    assert [s["verdict"] for s in corrected["steps"] if s["role"] == "judge"] == [False, True, True]
    assert [s["solution"] for s in corrected["steps"]] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert corrected["system_correct"] and not corrected["solver_correct"] and set(corrected) == RECORD_FIELDS
    summary = summarize(records, ["a", "b"], 2, imo)
    assert list(summary["roles"]) == ["judge", "corrector"] and list(summary["tokens"]) == list(imo.roles)
    # as MarsRL's Verifier above: a1's right 4 rejected and broken, b0's wrong 4 accepted, b1's fixed
    assert summary["roles"]["judge"] == {
        "acc_on_right": 4 / 5, "acc_on_wrong": 1 / 5, "calls_on_right": 5, "calls_on_wrong": 5,
    }  # fmt: skip
    assert summary["roles"]["corrector"]["fix_rate"] == 1.0 and summary["tokens"]["judge"]["calls"] == 10
    assert summary["tokens"]["verifier"]["calls"] == 10 and summary["system_acc"] == 0.5
    assert list(eval_metrics(summary, 0.0, imo)) == [
        "eval/solver_acc", "eval/system_acc", "eval/solver_pass@2", "eval/system_pass@2",
        "eval/accepted_rate", "eval/judge_acc_on_right", "eval/judge_acc_on_wrong",
        "eval/corrector_fix_rate", "eval/time",
    ]  # fmt: skip


def test_eval_takes_the_graph_and_prompts_of_the_trained_run(tmp_path: Path) -> None:
    """--graph defaults to --config's agents.graph (with its prompt set), else the default graph; a
    prompt set the graph lacks is refused naming the flag."""
    import argparse

    from mars_megatron.evaluation.command import add_arguments, settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--data", "d", "--model", "m", "--engine", "transformers", "--samples", "1", "--out", "o"]
    config = tmp_path / "run.yaml"
    config.write_text("agents:\n  graph: imo_refine\n  prompts: compact\n")
    chosen = settings(parser.parse_args([*base, "--config", str(config)]))
    assert (chosen.graph.name, chosen.prompts) == ("imo_refine", "compact")
    chosen = settings(parser.parse_args([*base, "--config", str(config), "--graph", "marsrl"]))
    assert (chosen.graph.name, chosen.prompts) == ("marsrl", "marsrl")
    assert settings(parser.parse_args(base)).graph.name == "marsrl"
    with pytest.raises(ValueError, match=r"--prompts: .*graph 'imo_refine' has no prompt set 'marsrl'"):
        settings(parser.parse_args([*base, "--graph", "imo_refine", "--prompts", "marsrl"]))
    with pytest.raises(
        ValueError, match=r"--graph: agents\.graph: no shipped graph 'nope'; shipped: .*imo_refine"
    ):
        settings(parser.parse_args([*base, "--graph", "nope"]))
    budgets = sampling.record(chosen.evaluation, load_graph("imo_refine"))["system"]
    assert budgets == {"start_retries": 3, "max_iterations": 30, "accept_after": 5, "give_up_after": 10}


def test_checkpoint_policies_route_each_role_of_the_graph(tmp_path: Path) -> None:
    """--checkpoint: a shared policy answers every role, one per role its own, and a graph's grouping
    (algorithm.policies=graph) each role its group's; other names are refused naming the grouping."""
    import shutil

    from mars_megatron.evaluation.policies import PolicyError, checkpoint_policies

    folder = tmp_path / "grouped"
    shutil.copytree(REPO / "mars_megatron" / "agents" / "graphs" / "imo_refine", folder)
    text = (folder / "graph.yaml").read_text()
    grouped = text.replace(
        "  shared: [solver, verifier, judge, corrector]",
        "  writer: [solver, corrector]\n  critic: [verifier, judge]",
    )
    assert grouped != text
    (folder / "graph.yaml").write_text(grouped.replace("name: imo_refine", "name: grouped"))
    graph = load_graph(str(folder))

    def step(policies: list[str]) -> Path:
        path = tmp_path / "-".join(policies) / "step_000001"
        path.mkdir(parents=True)
        state = {"format": "mars-trainer-state-v1", "state": {"policies": policies}}
        (path / "trainer_state.json").write_text(json.dumps(state))
        for name in policies:
            (path / name).mkdir()
            (path / name / "mars_checkpoint.json").write_text("{}")
        return path

    def routing(policies: list[str]) -> dict[str, str]:
        return {role: source.name for role, source in checkpoint_policies(step(policies), graph)[1].items()}

    assert routing(["shared"]) == dict.fromkeys(graph.roles, "shared")
    assert routing(["judge", "solver", "verifier", "corrector"]) == {r: r for r in graph.roles}
    assert routing(["writer", "critic"]) == {
        "solver": "writer", "verifier": "critic", "judge": "critic", "corrector": "writer",
    }  # fmt: skip
    with pytest.raises(PolicyError, match=r"nor graph 'grouped''s grouping \['critic', 'writer'\]"):
        routing(["writer"])


def test_runner_limits_concurrency_and_keeps_results_finished_before_an_engine_failure():
    engine = ScriptedEngine()
    runner, records, jobs = run_scripted(engine, max_concurrent=1)
    runner.run(jobs)
    assert max(len(b) for b in engine.batches) == 1 and len(records) == 4

    runner, records, jobs = run_scripted(ScriptedEngine(fail_on_call=4), max_concurrent=2)
    with pytest.raises(EngineFailure, match="endpoint went away"):
        runner.run(jobs)
    assert [(r["problem_id"], r["sample"]) for r in records] == [("a", 0)]


def test_runner_records_a_prompt_over_the_input_cap_as_an_empty_truncated_call():
    runner, records, jobs = run_scripted(ScriptedEngine(), codec=ScriptedCodec(too_long_role="verifier"))
    runner.run(jobs[:1])
    steps = records[0]["steps"]
    assert [(s["role"], s["prompt_too_long"], s["truncated"]) for s in steps] == [
        ("solver", False, False), ("verifier", True, True), ("corrector", False, False),
        ("verifier", True, True),
    ]  # fmt: skip
    assert records[0]["stop_reason"] == "gave_up" and steps[1]["prompt_tokens"] == 40000


# ---------------------------------------------------------------- the real CLI on the tiny model


def mars(*args, timeout=300):
    cmd = [sys.executable, "-m", "mars_megatron.cli", "eval", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def mars_here(*args):
    """`mars eval` refused before anything starts, run in this process (tests/test_cli.py: mars_here)."""
    from tests.test_cli import mars_here as here

    return here("eval", *args, cwd=REPO)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mars_megatron.models.presets import init_model

    return init_model("tiny-moe", tmp_path_factory.mktemp("model") / "tiny-moe")


def eval_args(model_dir, out, *extra):
    return ("--data", AIME, "--model", model_dir, "--engine", "transformers", "--samples", 2, "--limit", 3,
            "--max-tokens", 16, "--out", out, "--checker-workers", 1, *extra)  # fmt: skip


@pytest.fixture(scope="module")
def whole_run(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "out"
    proc = mars(*eval_args(model_dir, out, "--max-concurrent", 1))
    assert proc.returncode == 0, proc.stderr
    return out


def without_run(summary_path):
    summary = json.loads(Path(summary_path).read_text())
    return {k: v for k, v in summary.items() if k != "run"}, summary["run"]


def test_cli_end_to_end_writes_one_line_per_problem_and_sample(whole_run):
    records = [json.loads(line) for line in (whole_run / "results.jsonl").read_text().splitlines()]
    assert len(records) == 6
    assert sorted((r["problem_id"], r["sample"]) for r in records) == [(p, s) for p in "012" for s in (0, 1)]
    for r in records:
        assert set(r) == RECORD_FIELDS and r["steps"] and r["steps"][0]["role"] == "solver"
        assert all(STEP_FIELDS <= set(s) and 1 <= s["output_tokens"] <= 16 for s in r["steps"])
    summary, run = without_run(whole_run / "summary.json")
    assert summary["results"] == 6 and summary["problems"] == 3 and summary["samples"] == 2
    assert summary["missing_results"] == 0 and summary["skipped_lines"] == 0
    assert 0.0 <= summary["solver_acc"] <= 1.0 and 0.0 <= summary["system_acc"] <= 1.0
    assert set(summary["pass@k"]["solver"]) == set(summary["pass@k"]["system"]) == {"1", "2"}
    assert summary["tokens"]["solver"]["calls"] >= 6 and summary["checker"]["timeouts"] == 0
    assert summary["tokens"]["solver"]["output_total"] == sum(
        s["output_tokens"] for r in records for s in r["steps"] if s["role"] == "solver"
    )
    assert run["results_new"] == 6 and run["results_resumed"] == 0


def test_cli_runs_the_imo_graph_on_the_tiny_model(model_dir, tmp_path):
    """`mars eval --graph imo_refine` runs that graph's loop on a real engine; --policy names its roles.
    (The random tiny model's outputs seldom end within the budget, so its loop mostly stops at the start
    step; the scripted engine above walks the whole loop.)"""
    out = tmp_path / "imo"
    extra = ("--graph", "imo_refine", "--prompts", "compact", "--max-iterations", 2, "--limit", 1,
             "--samples", 1, "--policy", f"judge={model_dir}")  # fmt: skip
    proc = mars(*eval_args(model_dir, out, *extra))
    assert proc.returncode == 0, proc.stderr
    (record,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    roles = [s["role"] for s in record["steps"]]
    assert roles[0] == "solver" and set(roles) <= {"solver", "verifier", "judge", "corrector"}
    assert record["stop_reason"] in {"accepted", "gave_up", "max_iterations", "solver_truncated"}
    if record["stop_reason"] != "solver_truncated":
        assert roles.count("judge") == 2 or record["stop_reason"] != "max_iterations"
    config = json.loads((out / "config.json").read_text())
    assert config["graph"] == "imo_refine" and config["prompts"] == "compact"
    assert config["system"] == {
        "start_retries": 3,
        "max_iterations": 2,
        "accept_after": 5,
        "give_up_after": 10,
    }
    assert set(config["model"]) == {"solver", "verifier", "judge", "corrector"}
    summary, _ = without_run(out / "summary.json")
    assert set(summary["roles"]) == {"judge", "corrector"} and "solver_acc" in summary
    proc = mars(
        *eval_args(model_dir, tmp_path / "bad", "--graph", "imo_refine", "--policy", f"critic={model_dir}")
    )
    assert (
        proc.returncode == 2
        and "--policy critic=...: unknown role; valid roles: solver, verifier, judge" in (proc.stderr)
    )


@pytest.mark.parametrize("graph", ["tool_pair", "examples/graphs/solve_and_check"])
def test_cli_runs_any_graph_on_the_tiny_model(model_dir, tmp_path, graph):
    """`mars eval --graph` runs the loop of the tool pair (its calls served inside the reasoner's step)
    and of a user's graph file on a real engine (the loops on scripted outputs: test_agents_loop*.py)."""
    out = tmp_path / "out"
    data = DATA / ("tool_sums_test.jsonl" if graph == "tool_pair" else "arith_test.jsonl")
    extra = ("--data", data, "--graph", graph, "--prompts", "compact", "--limit", 2, "--samples", 1)
    proc = mars(*eval_args(model_dir, out, *extra))
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    graph_roles = {"tool_pair": {"reasoner", "distiller"}}.get(graph, {"solver", "checker"})
    assert len(records) == 2 and all({s["role"] for s in r["steps"]} <= graph_roles for r in records)
    config = json.loads((out / "config.json").read_text())
    assert config["graph"] == Path(graph).name and set(config["model"]) == graph_roles


def test_killed_run_resumes_to_the_same_summary(whole_run, model_dir, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mars_megatron.cli", "eval", *map(str, eval_args(model_dir, out))]
    proc = subprocess.Popen(
        [*cmd, "--max-concurrent", "1"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    results = out / "results.jsonl"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if results.exists() and results.read_text().count("\n") >= 1:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=30)
    # Keep the first finished line and leave a half-written one, as a kill mid-write would.
    first = results.read_text().splitlines()[0]
    results.write_text(first + "\n" + first[: len(first) // 2])

    resumed = mars(*eval_args(model_dir, out, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert "dropping an unreadable result line" in resumed.stderr
    summary, run = without_run(out / "summary.json")
    assert summary == without_run(whole_run / "summary.json")[0]
    assert run == {**run, "results_resumed": 1, "results_new": 5, "dropped_result_lines": 1}
    assert len(results.read_text().splitlines()) == 6


def test_cli_refuses_bad_setups(model_dir, whole_run, tmp_path):
    proc = mars_here(*eval_args(model_dir, whole_run))
    assert proc.returncode == 2 and f"--out {whole_run} exists and is not empty" in proc.stderr
    proc = mars_here(*eval_args(model_dir, whole_run, "--resume", "--temperature", "1.0"))
    assert proc.returncode == 2 and "other settings" in proc.stderr and "temperature" in proc.stderr
    proc = mars_here(
        *eval_args(model_dir, tmp_path / "o1")[:5], "nope", "--samples", 1, "--out", tmp_path / "o2"
    )
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr
    args = [a if a != "transformers" else "openai" for a in eval_args(model_dir, tmp_path / "o3")]
    proc = mars_here(*args)
    assert proc.returncode == 2 and "--engine openai needs --endpoint" in proc.stderr
    # what answers each role: a missing checkpoint, a folder that is no model, an unknown role
    base = ("--data", AIME, "--engine", "transformers", "--samples", 1, "--out", tmp_path / "o4")
    proc = mars_here(*base, "--checkpoint", tmp_path / "none")
    assert proc.returncode == 2 and f"--checkpoint {tmp_path / 'none'}: no such directory" in proc.stderr
    proc = mars_here(*base, "--checkpoint", tmp_path)
    assert proc.returncode == 2 and "neither a checkpoint (no trainer_state.json) nor" in proc.stderr
    proc = mars_here(*base, "--model", tmp_path)
    assert proc.returncode == 2 and "neither an HF model (config.json and *.safetensors) nor" in proc.stderr
    proc = mars_here(*base, "--model", model_dir, "--policy", f"judge={model_dir}")
    assert proc.returncode == 2 and "--policy judge=...: unknown role" in proc.stderr
    proc = mars_here(*base, "--model", model_dir, "--checkpoint", tmp_path)
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr
    proc = mars_here(*base, "--model", model_dir, "--config", tmp_path / "run.yaml")
    assert proc.returncode == 2 and "--config" in proc.stderr and "no such file" in proc.stderr
    assert not (tmp_path / "o4").exists()  # refused before anything was written
    # bad sampling flags are refused before OUT is written (a rerun is then still possible)
    for flags, message in (
        (("--max-tokens", 0), "--max-tokens: expected a positive int, got 0"),
        (("--top-p", 2), "--top-p: expected float <= 1, got 2.0"),
        (("--temperature", "nan"), "--temperature: expected a finite float, got nan"),
        (("--max-concurrent", 0), "--max-concurrent must be in [1, 65536], got 0"),
    ):
        proc = mars_here(*base, "--model", model_dir, *flags)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert not (tmp_path / "o4").exists()


def test_resume_refuses_changed_data_and_a_missing_config(model_dir, whole_run, tmp_path):
    """The data file is fingerprinted: the same path with other contents is not resumed into old results;
    results whose config.json was deleted are not resumed either (their settings are unknown)."""
    import shutil

    data = tmp_path / "aime.jsonl"
    data.write_text(AIME.read_text())
    out = tmp_path / "out"
    args = list(eval_args(model_dir, out))
    args[args.index(AIME)] = data
    ok_run = mars(*args, "--limit", 1, "--samples", 1)
    assert ok_run.returncode == 0, ok_run.stderr
    config = json.loads((out / "config.json").read_text())
    assert len(config["data_sha256"]) == 64
    data.write_text(AIME.read_text().replace('"ans_box"', '"answer"', 1))  # same path, other contents
    proc = mars_here(*args, "--limit", 1, "--samples", 1, "--resume")
    assert proc.returncode == 2 and "other settings" in proc.stderr and "data_sha256" in proc.stderr
    copy = tmp_path / "copy"
    shutil.copytree(whole_run, copy)
    (copy / "config.json").unlink()
    proc = mars_here(*eval_args(model_dir, copy, "--resume"))
    assert proc.returncode == 2 and "has no config.json beside it" in proc.stderr


def test_cli_counts_bad_data_lines_and_reports_an_unreachable_endpoint(model_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"query": "1+1?", "ans_box": 2}\n{"query": "oops"\n{"ans_box": 1}\n')
    args = ["--data", data, "--model", model_dir, "--samples", 1, "--max-tokens", 4, "--checker-workers", 1]
    proc = mars(*args, "--engine", "transformers", "--out", tmp_path / "ok")
    assert proc.returncode == 0, proc.stderr
    assert f"{data}:2" in proc.stderr and f"{data}:3" in proc.stderr
    summary, _ = without_run(tmp_path / "ok" / "summary.json")
    assert summary["skipped_lines"] == 2 and summary["results"] == 1

    proc = mars(*args, "--engine", "openai", "--endpoint", "http://127.0.0.1:9", "--out", tmp_path / "down")
    assert proc.returncode == 1, proc.stderr
    assert "engine failed" in proc.stderr and "127.0.0.1:9" in proc.stderr and "--resume" in proc.stderr
    assert (tmp_path / "down" / "results.jsonl").read_text() == ""


def test_chat_codec_refuses_or_truncates_long_prompts(model_dir):
    from mars_megatron.rollout.chat import ChatCodec

    messages = [{"role": "user", "content": "x " * 200 + "\n\nAnswer in \\boxed{}."}]
    full = ChatCodec.from_pretrained(model_dir).encode(messages)
    with pytest.raises(
        PromptTooLongError, match=f"prompt has {len(full)} tokens, more than max_input_tokens=64"
    ):
        ChatCodec.from_pretrained(model_dir, max_input_tokens=64).encode(messages)
    cut = ChatCodec.from_pretrained(model_dir, max_input_tokens=64, truncate=True).encode(messages)
    assert len(cut) == 64 and cut[:48] == full[:48] and cut[48:] == full[-16:]  # head and generation prompt
    assert ChatCodec.from_pretrained(model_dir).decode(full).startswith("user")


def test_training_refuses_an_evaluation_that_is_not_held_out(tmp_path: Path) -> None:
    """`mars train` checks evaluation.* before anything starts: an interval without a test file, a missing
    file, and a test file that shares problems with data.train_file (a score on trained problems)."""
    from mars_megatron.config import ConfigError, load_config
    from mars_megatron.models.presets import init_model
    from mars_megatron.pipeline.trainer import prepare

    data = REPO / "examples" / "data"
    model = init_model("tiny-moe", tmp_path / "hf")
    common = [f"model.hf_dir={model}", f"data.train_file={data / 'arith_train.jsonl'}",
              f"logging.run_dir={tmp_path / 'run'}", "evaluation.interval=5"]  # fmt: skip
    example = REPO / "examples" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match=r"evaluation\.interval: is 5 but test_file is null"):
        load_config(example, [*common, "evaluation.test_file=null"])
    cfg = load_config(example, [*common, f"evaluation.test_file={tmp_path / 'none.jsonl'}"])
    with pytest.raises(ConfigError, match=r"evaluation\.test_file: .*none\.jsonl: no such file"):
        prepare(cfg, nproc=None, resume=None, check_machine=False)
    cfg = load_config(example, [*common, f"evaluation.test_file={data / 'arith_train.jsonl'}"])
    with pytest.raises(
        ConfigError, match=r"evaluation\.test_file: 75 of its problems are also in data\.train_file"
    ):
        prepare(cfg, nproc=None, resume=None, check_machine=False)
    cfg = load_config(
        example, [*common, f"evaluation.test_file={data / 'arith_test.jsonl'}", "evaluation.limit=7"]
    )
    plan = prepare(cfg, nproc=None, resume=None, check_machine=False)
    assert len(plan.eval_problems) == 7 and len(plan.problems) == 75


def test_served_model_names_per_role_for_an_openai_endpoint() -> None:
    """--engine openai: one NAME for every role, ROLE=NAME per role, else each policy's own name (a
    per-role checkpoint is served as solver/verifier/corrector); anything else is refused."""
    import argparse

    from mars_megatron.evaluation.command import _served_names
    from mars_megatron.evaluation.policies import PolicySource

    per_role = {r: PolicySource(r, Path(r)) for r in ROLES}
    one = dict.fromkeys(ROLES, PolicySource("model", Path("m")))

    def names(served: list[str], sources: dict, model: str | None = None) -> dict[str, str]:
        return _served_names(argparse.Namespace(served_model=served, model=model), sources)

    assert names([], per_role) == {"solver": "solver", "verifier": "verifier", "corrector": "corrector"}
    assert names([], one, model="ckpt/x") == dict.fromkeys(["solver", "verifier", "corrector"], "ckpt/x")
    assert names(["all", "verifier=judge"], per_role) == {
        "solver": "all",
        "verifier": "judge",
        "corrector": "all",
    }
    with pytest.raises(ValueError, match="--served-model"):
        names(["a", "b"], per_role)
    with pytest.raises(ValueError, match="--served-model"):
        names(["judge=x"], per_role)


def test_engine_pool_splits_requests_across_engines_and_keeps_their_order() -> None:
    """Training's held-out evaluation puts a policy's engines behind one generate: contiguous shares, one
    per engine, decoded side by side, outputs back in request order; an engine's error is raised."""
    from mars_megatron.rl.evaluate import EnginePool

    class Echo:
        def __init__(self, fail: bool = False) -> None:
            self.seen: list[str] = []
            self.fail = fail

        def generate(self, requests):
            if self.fail:
                raise ConnectionError("engine gone")
            self.seen += [r.request_id for r in requests]
            return [GenerationOutput(r.request_id, [int(r.request_id)], [0.0], "stop") for r in requests]

    params = sampling.params(EvalConfig(max_tokens=4), 0)
    requests = [GenerationRequest(str(i), (1,), params) for i in range(7)]
    engines = [Echo(), Echo(), Echo()]
    outputs = EnginePool(engines).generate(requests)
    assert [o.token_ids for o in outputs] == [[i] for i in range(7)]
    assert [e.seen for e in engines] == [["0", "1"], ["2", "3"], ["4", "5", "6"]]
    alone = Echo()
    assert [o.request_id for o in EnginePool([alone, Echo()]).generate(requests[:1])] == ["0"]
    assert alone.seen == ["0"]
    with pytest.raises(ConnectionError, match="engine gone"):
        EnginePool([Echo(), Echo(fail=True)]).generate(requests)
