"""Shared test setup.

- ``gpu`` tests skip cleanly without CUDA.
- Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must be set
  before any kernel module is imported, so it is set here, first.
"""
import os
import sys

import pytest
import torch
import torch.distributed as dist

# test helpers shared across folders (e.g. runtime.dist_harness) import from here
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank gloo process group for single-process tests of distributed code
    (use with ``pytestmark = pytest.mark.usefixtures("one_rank_group")``)."""
    if dist.is_initialized():
        yield
        return
    from runtime.dist_harness import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
