"""Weight decay by name or ndim on a wrapped model groups every original parameter as
the unwrapped model does (split, tied and rep units), and 5 AdamW steps with weight
decay and clipping on 2 gloo ranks match single-process training; see
``param_groups_cases.py``. Tolerances as the parity tests (fp32, AdamW eps=1e-5)."""
from __future__ import annotations

import pytest
import torch

from . import param_groups_cases as gc
from . import parity_cases as pc

WORLD = 2
_RESULTS: dict = {}


def results():
    if not _RESULTS:
        _RESULTS.update(gc.runs(WORLD))
    return _RESULTS


@pytest.mark.parametrize("key", ["uneven", "tied"])
def test_every_idiom_groups_like_the_unwrapped_model(key):
    plain = pc.make_model(key)
    expected = gc.grouping(list(plain.named_parameters()), gc.hf_decay_names(plain))
    for run in results()[key]:
        for idiom, classes in expected.items():
            assert run["grouping"][idiom] == classes, idiom


@pytest.mark.parametrize("key", ["uneven", "tied"])
def test_hf_rule_on_the_wrapped_model_names_what_it_names_unwrapped(key):
    plain = pc.make_model(key)
    for run in results()[key]:
        assert run["hf_names_wrapped"] == sorted(gc.hf_decay_names(plain))


@pytest.mark.parametrize("key", ["uneven", "tied"])
def test_adamw_with_weight_decay_matches_single_process(key):
    ref_losses, ref_norms, ref_state = gc.reference(key, WORLD)
    run = results()[key][0]
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for r in results()[key]:
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    assert list(run["state"]) == list(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(run["state"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
