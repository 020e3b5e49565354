"""Whether a run can go on after losing a node (:mod:`mars_megatron.pipeline.nodes`): the pure decision,
on the shapes Ray reports. The real loss of a node, on a Slurm cluster of three, is in test_slurm_real."""

from __future__ import annotations

import pickle

import pytest

from mars_megatron.pipeline.nodes import ClusterNode, Holding, NodeLost, check, first_fit, lost_nodes
from mars_megatron.reaper import WorkerProcess


def node(i: int, cpus: float, alive: bool = True, gpus: float = 0.0) -> ClusterNode:
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return ClusterNode(f"n{i}", f"10.0.0.{i}", f"host{i}", alive, resources)


def held(kind: str, index: int, on: int, cpus: float, gpus: float = 0.0) -> Holding:
    process = WorkerProcess(f"n{on}", f"10.0.0.{on}", 1000 + index, f"ray::{kind}")
    return Holding(kind, index, f"{kind} {index}", process, {"CPU": cpus, "GPU": gpus})


# the three-node layout of test_slurm_real: 2 CPUs a node, ranks of 2 CPUs on nodes 2 and 3, the engine and
# the reward worker on node 1
RUN = [held("rank", 0, 2, 2), held("rank", 1, 3, 2), held("engine", 0, 1, 1), held("reward", 0, 1, 1)]


def test_first_fit_places_the_largest_first_and_says_when_one_finds_no_room() -> None:
    free = [{"CPU": 3.0}, {"CPU": 2.0, "GPU": 1.0}]
    assert first_fit([{"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 1.0, "GPU": 1.0}], free) == [0, 0, 1]
    assert first_fit([{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 2.0}], free) is None
    assert first_fit([{"GPU": 2.0}], free) is None
    assert first_fit([], []) == []


def test_nothing_is_checked_while_every_node_of_the_run_is_alive() -> None:
    nodes = [node(1, 2), node(2, 2), node(3, 2)]
    assert check(RUN, [RUN[0], RUN[1]], nodes) == []
    assert lost_nodes(RUN, nodes) == {}
    # a node the run has nothing on may die: not the run's loss
    assert check(RUN, RUN[:2], [*nodes, node(4, 8, alive=False)]) == []


def test_a_lost_node_without_room_left_stops_the_run_naming_the_node_and_what_it_held() -> None:
    nodes = [node(1, 2), node(2, 2), node(3, 2, alive=False)]
    with pytest.raises(NodeLost) as e:
        check(RUN, [h for h in RUN if h.kind == "rank"], nodes)
    said = str(e.value)
    assert said.startswith("node host3 (10.0.0.3) is lost (Ray counts it dead): it held rank 1.")
    # the whole group starts again (4 CPUs) where only node 2's 2 CPUs are free (node 1 is full)
    assert "(2 actor(s), 4 CPU in all: rank 0, rank 1)" in said
    assert "free on the nodes left: host1 (10.0.0.1) 0 CPU, host2 (10.0.0.2) 2 CPU" in said
    assert "`mars launch --resume`" in said
    assert [n.node_id for n in e.value.nodes] == ["n3"]
    again = pickle.loads(pickle.dumps(e.value))  # it crosses Ray's edge whole
    assert str(again) == said and again.nodes == e.value.nodes


def test_a_lost_node_with_spares_left_lets_the_run_go_on_and_says_which_was_lost() -> None:
    nodes = [node(1, 4), node(2, 2), node(3, 2, alive=False)]  # node 1 has 2 CPUs spare
    assert [n.node_id for n in check(RUN, [h for h in RUN if h.kind == "rank"], nodes)] == ["n3"]
    # the engine of a lost node must find room as well, with what stays where it is
    run = [held("rank", 0, 2, 2), held("rank", 1, 2, 2), held("engine", 0, 3, 1), held("reward", 0, 1, 1)]
    assert check(run, [run[2]], [node(1, 2), node(2, 4), node(3, 2, alive=False)])
    with pytest.raises(NodeLost, match=r"it held engine 0\. .*\(1 actor\(s\), 1 CPU in all: engine 0\)"):
        check(run, [run[2]], [node(1, 1), node(2, 4), node(3, 2, alive=False)])


def test_what_was_on_a_lost_node_counts_even_when_something_else_is_replaced() -> None:
    # a reward worker is replaced, but the lost node also held a rank: both need room
    run = [held("rank", 0, 2, 2), held("reward", 0, 1, 1)]
    nodes = [node(1, 2), node(2, 2, alive=False)]
    with pytest.raises(NodeLost, match=r"3 CPU in all: reward 0, rank 0"):
        check(run, [run[1]], nodes)


def test_a_node_ray_no_longer_knows_is_lost_under_the_address_its_actors_gave() -> None:
    nodes = [node(1, 2), node(2, 2)]  # node 3 forgotten
    with pytest.raises(NodeLost, match=r"^node 10\.0\.0\.3 is lost"):
        check(RUN, RUN[:2], nodes)


def test_gpus_are_counted_as_well_as_cpus() -> None:
    run = [held("rank", 0, 1, 1, 1), held("rank", 1, 2, 1, 1)]
    nodes = [node(1, 8, gpus=1), node(2, 8, alive=False, gpus=1), node(3, 8)]  # node 3: CPUs, no GPU
    with pytest.raises(NodeLost, match=r"2 CPU \+ 2 GPU in all"):
        check(run, run, nodes)
    assert check(run, run, [*nodes[:2], node(3, 8, gpus=1)])
