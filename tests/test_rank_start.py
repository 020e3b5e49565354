"""How ``parallel.launch`` starts its ranks (training/rank_start.py): forked from a server that has imported
torch and Megatron-Core, yet seeing what a spawned rank sees, with the same numerics."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from mars_megatron.training import parallel, rank_start

pytestmark = pytest.mark.multiproc

MARK = "MARS_RANK_START_MARK"
FORKS = pytest.mark.skipif(torch.cuda.is_available(), reason="where CUDA is visible, ranks are spawned")


def _whoami() -> tuple[int, str, str | None, list[str]]:
    rank = dist.get_rank()
    print(f"rank {rank} writes to stdout", flush=True)
    print(f"rank {rank} writes to stderr", file=sys.stderr, flush=True)
    return os.getppid(), os.getcwd(), os.environ.get(MARK), sys.path[:1]


def _numerics() -> bytes:
    """MKL GEMM, VML exp and a gloo all-reduce: what the pins of runtime_env decide."""
    torch.manual_seed(1234 + dist.get_rank())
    a = torch.randn(192, 160)
    x = (a @ a.T).softmax(-1).exp().sum(0)
    dist.all_reduce(x)
    return x.numpy().tobytes()


@FORKS
def test_a_forked_rank_has_the_callers_environment_directory_path_and_output(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path
) -> None:
    monkeypatch.delenv(MARK, raising=False)
    first = parallel.launch(_whoami, 2, timeout_s=300)
    server = first[0][0]
    assert server != os.getpid() and {r[0] for r in first} == {server}  # forked, by one server
    out, err = capfd.readouterr()
    assert "rank 0 writes to stdout" in out and "rank 1 writes to stdout" in out
    assert "rank 1 writes to stderr" in err and "rank 1 writes to stdout" not in err

    # what multiprocessing hands over itself, at each start: the server keeps serving
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    moved = parallel.launch(_whoami, 1, timeout_s=300)
    assert moved == [(server, str(tmp_path), None, [str(tmp_path)])]

    # a changed environment: libraries read some of it as they load, so a new server starts with it
    monkeypatch.setenv(MARK, "1")
    marked = parallel.launch(_whoami, 1, timeout_s=300)
    assert marked[0][2] == "1" and marked[0][0] not in (server, os.getpid())

    spawned = parallel.launch(_whoami, 1, timeout_s=300, start_method="spawn")
    assert spawned == [(os.getpid(), str(tmp_path), "1", [str(tmp_path)])]


@FORKS
def test_forked_and_spawned_ranks_compute_the_same_bits() -> None:
    forked = parallel.launch(_numerics, 2, timeout_s=300, start_method="forkserver")
    spawned = parallel.launch(_numerics, 2, timeout_s=300, start_method="spawn")
    assert forked == spawned and forked[0] == forked[1]


def _dies() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


@pytest.mark.parametrize("start_method", [pytest.param("forkserver", marks=FORKS), "spawn"])
def test_a_rank_that_dies_without_a_word_is_named_with_its_exit_code(start_method: str) -> None:
    """A forked rank's exit status reaches the caller through the server, as a spawned rank's does; the
    peer that saw the broken connection is reported after the rank that died."""
    died = r"ranks \[1\] died without a report \(exit codes \{1: 3\}\)(; then rank 0 of 2 failed)?"
    with pytest.raises(RuntimeError, match=died):
        parallel.launch(_dies, 2, timeout_s=120, start_method=start_method)


def test_a_rank_result_loads_after_the_rank_is_gone() -> None:
    """With ``torch.multiprocessing`` imported (a forked rank has it from the server), multiprocessing's
    pickler sends a tensor as a file descriptor for the caller to fetch from the rank: gone, once the rank
    has exited (CI's first run with the fork server failed so). A result is plain bytes."""
    code = (
        "import sys, torch, torch.multiprocessing\n"
        "from mars_megatron.training import parallel\n"
        "sys.stdout.buffer.write(parallel.result_bytes(print, {'t': torch.arange(6.0)}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, timeout=300)
    assert torch.equal(pickle.loads(done.stdout)["t"], torch.arange(6.0))


def test_an_unknown_start_method_is_named() -> None:
    with pytest.raises(ValueError, match=r"start_method must be one of forkserver, spawn, got 'fork'"):
        parallel.launch(_whoami, 1, start_method="fork")


def test_ranks_fork_on_cpu_hosts_and_spawn_on_cuda_hosts() -> None:
    expected = "spawn" if torch.cuda.is_available() else "forkserver"
    assert rank_start.choose() == expected
