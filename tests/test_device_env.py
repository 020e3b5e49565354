"""A GPU node's environment, checked on CPU: which CUDA device a rank binds
(``parallel.cuda_device_index``: an inherited or inconsistent ``LOCAL_RANK`` is refused with an error
naming it, and the processes ``parallel.launch`` spawns are numbered by their rank whatever ``LOCAL_RANK``
their parent had), and the NVIDIA driver torch's CUDA build needs (``tools/gpu_check.py``)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from mars_megatron.training import parallel
from mars_megatron.training.parallel import cuda_device_index
from tests.test_gpu_check import load_gpu_check


def test_torchrun_local_rank_is_used_when_consistent() -> None:
    env = {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}
    assert cuda_device_index(11, 16, 8, env, spawned=False) == 3
    assert cuda_device_index(5, 8, 8, {}, spawned=False) == 5  # no LOCAL_RANK: rank % devices
    # one GPU per task (Slurm --gpus-per-task, Ray): the only visible device, whatever the local rank
    assert cuda_device_index(6, 8, 1, {"LOCAL_RANK": "6", "LOCAL_WORLD_SIZE": "8"}, spawned=False) == 0


@pytest.mark.parametrize(
    ("rank", "world", "devices", "env", "match"),
    [
        (0, 2, 2, {"LOCAL_RANK": "one"}, r"LOCAL_RANK='one' is not an integer"),
        (1, 2, 8, {"LOCAL_RANK": "5"}, r"LOCAL_RANK=5 with RANK=1: .*inherited"),
        (2, 4, 4, {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, r"LOCAL_RANK < LOCAL_WORLD_SIZE"),
        (3, 4, 4, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}, r"LOCAL_WORLD_SIZE <= WORLD_SIZE"),
        (5, 8, 4, {"LOCAL_RANK": "5", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, r"names no device: 4 .*0,1,2,3"),
        (0, 1, 0, {}, r"no CUDA device"),
    ],
)
def test_inconsistent_local_rank_is_refused(
    rank: int, world: int, devices: int, env: dict[str, str], match: str
) -> None:
    with pytest.raises(RuntimeError, match=match):
        cuda_device_index(rank, world, devices, env, spawned=False)


def test_spawned_ranks_ignore_the_parents_local_rank() -> None:
    inherited = {"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8"}
    assert [cuda_device_index(r, 2, 8, inherited, spawned=True) for r in range(2)] == [0, 1]
    with pytest.raises(RuntimeError, match=r"launch: 4 ranks on this machine but 2 visible"):
        cuda_device_index(3, 4, 2, {}, spawned=True)


def _local_env() -> tuple[str | None, str | None]:
    return os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")


@pytest.mark.multiproc
def test_launch_numbers_its_processes_by_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray trainer rank (or torchrun) that runs ``parallel.launch`` has a LOCAL_RANK of its own; its
    children must not all take it (on GPUs: every child on the parent's device)."""
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert parallel.launch(_local_env, 1, timeout_s=120) == [("0", "1")]


def test_an_old_driver_is_named_for_cuda_13_torch() -> None:
    gpu_check = load_gpu_check()
    problem = gpu_check.driver_problem("13.0", "575.57.08")
    assert problem is not None and "R580 or newer" in problem and "575.57.08" in problem
    assert gpu_check.driver_problem("13.0", "580.65.06") is None
    assert gpu_check.driver_problem("12.8", "575.57.08") is None  # a CUDA 12 torch runs on it
    assert gpu_check.driver_problem("13.0", None) is None  # no nvidia-smi: nothing to say


def test_a_trainer_rank_keeps_the_flight_recorder_from_ending_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight-transfer group's NCCL error sets torch's process-wide dump flag; the training world's
    heartbeat monitor would then terminate the rank unless that world was built with
    TORCH_NCCL_DUMP_ON_TIMEOUT=0 (transfer.group). A value the user set is kept."""
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT", raising=False)
    parallel.trainer_nccl_env()
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    parallel.trainer_nccl_env()
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def _unsendable() -> object:
    return threading.Lock()


@pytest.mark.multiproc
def test_a_rank_whose_result_cannot_be_sent_fails_the_launch_at_once() -> None:
    """The queue pickles in a feeder thread, where a failure was only printed: the parent waited for the
    rank until its timeout. Now the rank reports the failure, naming the function."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"_unsendable returned a value that cannot be sent back"):
        parallel.launch(_unsendable, 1, timeout_s=300)
    assert time.monotonic() - start < 120
