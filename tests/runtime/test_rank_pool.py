"""The tests' rank pool ([Note: test rank pool] in rank_pool.py): results like
``osdp.launch.spawn``, a fresh process group and process state for every task, and a
failing, dying or hanging task that comes back as an error and leaves a working pool."""
from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from .dist_harness import spawn
from .rank_pool import RankPool


def _sum_of_ranks(rank, world, extra):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world, t.item() + extra


def _dirty(rank, world):
    """Leave behind what a careless test could: a subgroup, global torch settings,
    environment, seeds, working directory, warning filters."""
    dist.new_group([0])
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    os.environ["OSDP_POOL_LEAK"] = "1"
    os.chdir("/")
    seed = torch.initial_seed()
    warnings.simplefilter("error")
    return seed


def _looks_fresh(rank, world):
    from torch.distributed import distributed_c10d as c10d

    return {
        "groups": len(c10d._world.pg_map),
        "dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "seed": torch.initial_seed(),
        "env": os.environ.get("OSDP_POOL_LEAK"),
        "cwd": os.getcwd(),
        "warnings_error": any(f[0] == "error" for f in warnings.filters),
    }


def _env_and_cwd(rank, world):
    return os.environ.get("OSDP_POOL_FROM_PARENT"), os.getcwd()


def test_a_task_sees_the_test_process_environment_and_cwd_of_the_moment(monkeypatch, tmp_path):
    monkeypatch.setenv("OSDP_POOL_FROM_PARENT", "yes")
    monkeypatch.chdir(tmp_path)
    assert spawn(_env_and_cwd, 2) == [("yes", str(tmp_path))] * 2


def test_results_in_rank_order_and_state_does_not_leak_to_the_next_task():
    assert spawn(_sum_of_ranks, 2, 10) == [(0, 2, 13.0), (1, 2, 13.0)]
    before = spawn(_looks_fresh, 2)
    assert spawn(_dirty, 2) == [0, 0]
    after = spawn(_looks_fresh, 2)
    for b, a in zip(before, after):
        assert a["groups"] == b["groups"] == 1, "only the task's own default group"
        assert a["seed"] not in (0, b["seed"]), "reseeded at random, as a fresh process"
        del a["seed"], b["seed"]
        assert a == b
        assert a["dtype"] == torch.float32 and a["env"] is None and not a["warnings_error"]


def _raise_while_peer_waits(rank, world):
    if rank == 1:
        raise ZeroDivisionError("rank 1 fails")
    t = torch.ones(1)
    dist.all_reduce(t)  # never completes: rank 1 is gone
    return t.item()


def _hang(rank, world):
    time.sleep(3600)


def _die(rank, world):
    if rank == 0:
        os._exit(7)
    dist.barrier()


@pytest.fixture(scope="module")
def own_pool():
    """A pool of its own: these tests break it on purpose."""
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.mark.slow  # the test harness's failure paths restart ranks: 8-11 s each
def test_a_rank_failing_while_its_peer_waits_comes_back_and_the_pool_recovers(own_pool):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 1:.*ZeroDivisionError: rank 1 fails"):
        own_pool.run(_raise_while_peer_waits)
    assert time.monotonic() - start < 60, "the waiting peer was not given up on"
    assert not own_pool.alive, "a failed task's pool is not reused"
    assert own_pool.run(_sum_of_ranks, 1) == [(0, 2, 4.0), (1, 2, 4.0)]


@pytest.mark.slow  # the test harness's failure paths restart ranks: 8-11 s each
def test_a_dead_rank_comes_back_with_its_exit_code(own_pool):
    with pytest.raises(RuntimeError, match=r"rank 0: the process died \(exit code 7\)"):
        own_pool.run(_die)
    assert own_pool.run(_sum_of_ranks, 0) == [(0, 2, 3.0), (1, 2, 3.0)]


@pytest.mark.slow  # the test harness's failure paths restart ranks: 8-11 s each
def test_a_hanging_task_times_out_with_its_stacks(own_pool):
    with pytest.raises(RuntimeError, match=r"(?s)ranks \[0, 1\] did not finish within 2 s.*in _hang"):
        own_pool.run(_hang, timeout_s=2)
    assert own_pool.run(_sum_of_ranks, 0) == [(0, 2, 3.0), (1, 2, 3.0)]
