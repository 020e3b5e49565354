"""The device rule of every tensor collective (comm/collectives.py): NCCL groups take GPU tensors,
gloo groups host tensors, decided from the group's backend in one place; the wrappers on a real gloo
world; and no code elsewhere in the package calling torch.distributed's tensor collectives directly, so
a host copy handed to NCCL (the first GPU weight export failed that way) cannot be written again."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from mars_megatron.comm.collectives import device_for_backend
from mars_megatron.training import parallel
from tests.dist_workers import collective_round

REPO = Path(__file__).resolve().parents[1]
TENSOR_COLLECTIVES = {
    "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all", "all_to_all_single", "broadcast",
    "gather", "irecv", "isend", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "send", "batch_isend_irecv",
}  # fmt: skip


def test_the_device_follows_the_backend_of_the_group() -> None:
    assert device_for_backend("nccl", 3) == torch.device("cuda", 3)
    assert device_for_backend("NCCL", 0) == torch.device("cuda", 0)
    assert device_for_backend("cpu:gloo,cuda:nccl", 1) == torch.device("cuda", 1)
    assert device_for_backend("gloo") == torch.device("cpu")
    assert device_for_backend("mpi") == torch.device("cpu")
    with pytest.raises(ValueError, match="needs this process's CUDA device index"):
        device_for_backend("nccl")
    with pytest.raises(ValueError, match="unknown process-group backend 'ucc'"):
        device_for_backend("ucc")


@pytest.mark.multiproc
def test_the_wrappers_on_a_gloo_world() -> None:
    r0, r1 = parallel.launch(collective_round, 2, timeout_s=300)
    for r in (r0, r1):
        assert r["device"] == "cpu"
        assert r["gathered"] == [[1.0, 1.0], [2.0, 2.0]]
        assert r["reduced_in_place"] and r["reduced"] == [3.0, 20.0]
        assert r["max"] == [1.0]
        assert r["strided_sum"] == [[0.0, 6.0], [2.0, 8.0], [4.0, 10.0]] and r["strided_untouched"]
        assert r["values"] == [2.0, 4.0]
    assert r0["received"] == [[0, 7, 14], [21, 28, 35]] and r1["received"] is None


def _direct_calls(path: Path) -> list[str]:
    """``dist.<collective>(...)`` / ``torch.distributed.<collective>(...)`` calls in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = ast.unparse(node.func.value)
        if node.func.attr in TENSOR_COLLECTIVES and owner in ("dist", "torch.distributed"):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {owner}.{node.func.attr}")
    return found


def test_no_tensor_collective_bypasses_the_device_rule() -> None:
    files = list((REPO / "mars_megatron").rglob("*.py"))
    assert len(files) > 50
    rule = REPO / "mars_megatron" / "comm" / "collectives.py"
    direct = [call for f in files if f != rule for call in _direct_calls(f)]
    assert direct == [], "call mars_megatron.comm.collectives instead:\n" + "\n".join(direct)
    assert _direct_calls(rule)  # the scan does see calls where they are
