"""Freezing and unfreezing after wrapping, through the original parameters'
``requires_grad`` (a backbone frozen for the first steps, a layer unfrozen late), on 2
gloo ranks against single-process training of the same schedule: split slices, dp,
zdp and rep units (one frozen when wrapped, unfrozen later: its gradient averaged
too), a tied head. Eager only: the compiled path computes from the parameters
themselves ([Note: trainability follows the parameters] in osdp/runtime/trainable.py)."""
from __future__ import annotations

import torch

from . import freeze_cases as fc
from .dist_harness import spawn


def test_freezing_after_wrapping_trains_as_single_process():
    ref_losses, ref_state = fc.reference(2)
    runs = spawn(fc.osdp_run, 2)
    for run in runs:
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for key, value in ref_state.items():
            torch.testing.assert_close(run["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
        assert ("unit 'blocks.0.ln_2' mixes frozen parameters (blocks.0.ln_2.weight) and trainable ones "
                "(blocks.0.ln_2.bias)") in run["mixed"], run["mixed"]
