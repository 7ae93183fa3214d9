"""Shared test setup.

- ``gpu`` tests skip cleanly without CUDA.
- ``--time-budget-s S``: once the run has taken S seconds, the tests not yet started are
  skipped, each saying so (``.ci/run`` runs the ``slow`` set within what is left of its
  20 minutes; a test that started always finishes).
- Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must be set
  before any kernel module is imported, so it is set here, first.
"""
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

# test helpers shared across folders (e.g. runtime.dist_harness) import from here
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread in the test process: the tests' tensors are small, so a second
# thread gains nothing, and when the cores are busy (the rank pool's processes, a test's
# subprocess, another job on the machine) OpenMP threads wait on each other: on 2 loaded
# cores tests/runtime/test_peak.py's [8] tracker test took 11.3 s with 2 threads, 3.4 s
# with 1. The rank pool's and spawn's ranks set their own (cores // world).
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--time-budget-s", type=float, default=None,
                     help="skip the tests not yet started once the run has taken this many seconds")


def pytest_configure(config):
    config._osdp_started = time.monotonic()


def pytest_sessionfinish(session, exitstatus):
    """Stop the rank pools ([Note: test rank pool] in runtime/rank_pool.py), if any started."""
    pool = sys.modules.get("runtime.rank_pool")
    if pool is not None:
        pool.shutdown()


def pytest_runtest_setup(item):
    budget = item.config.getoption("--time-budget-s")
    if budget is not None:
        spent = time.monotonic() - item.config._osdp_started
        if spent > budget:
            pytest.skip(f"over the run's time budget: {spent:.0f} s of --time-budget-s {budget:.0f} spent")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake_world(request):
    """A fake process group of ``request.param`` ranks (parametrize with
    ``indirect=True``), destroyed after the test: collectives return at once, so a
    wrapped model runs its real schedule on one process as rank 0 of a large world."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group leaked from another test module"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank gloo process group for single-process tests of distributed code
    (use with ``pytestmark = pytest.mark.usefixtures("one_rank_group")``)."""
    if dist.is_initialized():
        yield
        return
    # an in-memory store: one rank needs no rendezvous, and no port another test could take
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
