"""The fused head + loss ([Note: fused head on split slices]) on 2 gloo ranks: a GPT with
its head split along the vocabulary (untied, mixed per-slice modes) or tied to a
row-split embedding, with ignored tokens, against single-process training (losses and
final parameters at rtol 1e-5, AdamW). One spawn runs both cases."""
from __future__ import annotations

import pytest
import torch

from . import fused_head_cases as fc
from .dist_harness import spawn

_RESULTS: dict = {}


def results():
    if not _RESULTS:
        _RESULTS["r"] = spawn(fc.run_all, 2)
    return _RESULTS["r"]


@pytest.mark.parametrize("name", list(fc.CASES))
def test_fused_training_matches_single_process(name):
    rank0 = results()[0]
    losses, state, fused_calls = rank0["osdp"][name]
    assert fused_calls == fc.STEPS, "the GPT took the fused path"
    key = fc.CASES[name][0]
    ref_losses, ref_state = rank0["ref"][key]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert list(state) == list(ref_state)
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
    initial = fc.make(key).state_dict()
    assert max((state[k] - initial[k]).abs().max().item() for k in ref_state) > 1e-2, "it trained"
