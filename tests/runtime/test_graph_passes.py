"""A forward's graph walked by more than one backward pass, on 2 gloo ranks against one
process: ``backward(retain_graph=True)`` then another backward, and a gradient penalty
(``autograd.grad(..., create_graph=True)`` on an activation, then the backward of loss
+ penalty). Both crashed: the first pass freed the gathered weights the graph's saved
tensors alias, and the hooks on the modules' outputs fired once per forward, so the
second pass never gathered them again ("setStorage: ... out of bounds for storage of
size 0", or a segmentation fault); [Note: backward passes through one graph] in
osdp/runtime/scheduler.py."""
from __future__ import annotations

import pytest
import torch

from . import graph_passes_cases as gc
from .dist_harness import spawn

WORLD = 2
CASES = [(idiom, config) for idiom in gc.IDIOMS for config in gc.OSDP_ARGS]


@pytest.fixture(scope="module")
def results():
    return spawn(gc.run, WORLD, CASES)


@pytest.mark.parametrize("idiom,config", [case for case in CASES if case != ("penalized", "split")])
def test_backward_passes_through_one_graph_train_as_single_process(results, idiom, config):
    """Losses and parameters after 3 AdamW steps; nothing left gathered (but a rep unit,
    which keeps its weights)."""
    expected = gc.reference(idiom, WORLD)
    for rank_result in results:
        got = rank_result[(idiom, config)]
        assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        for key, value in expected["state"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)
        assert got["gathered"] == [] or config == "mixed" and got["gathered"] == ["ln_f"]


def test_a_gradient_penalty_through_a_split_op_names_it(results):
    """A split matmul's backward writes dX in place, which autograd cannot differentiate
    again: the error names the op's module and what to do (it was torch's "functions
    with out=... arguments don't support automatic differentiation"); training goes on
    after it."""
    for rank_result in results:
        assert "reached the split op of 'blocks.1.mlp.c_fc'" in rank_result[("penalized", "split")]["error"]
