"""Shared test setup.

- ``gpu`` tests skip cleanly without CUDA.
- Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must be set
  before any kernel module is imported, so it is set here, first.
"""
import os
import sys

import pytest
import torch

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
