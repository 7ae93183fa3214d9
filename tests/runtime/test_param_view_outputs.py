"""A module whose forward returns a view of its own parameter, on 2 gloo ranks against
one process (param_view_cases.py): the view outlived the module's forward, which frees
the gathered weights (zdp; dp's at the end of backward), and the next module read freed
storage: a segmentation fault on stock Perceiver (found by a helper). The output is now
copied off the gathered buffer (osdp/runtime/hooks.py ``_off_gathered``)."""
from __future__ import annotations

import pytest
import torch

from . import param_view_cases as pc
from .dist_harness import spawn

WORLD = 2


@pytest.fixture(scope="module")
def results():
    return spawn(pc.run, WORLD, list(pc.OSDP_ARGS))


@pytest.mark.parametrize("config", list(pc.OSDP_ARGS))
def test_a_view_of_a_parameter_returned_by_its_module_trains_as_single_process(results, config):
    plain = pc.build()
    losses = pc.train(plain, None, WORLD)
    for rank_result in results:
        got = rank_result[config]
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)
