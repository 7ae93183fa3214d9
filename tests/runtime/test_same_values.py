"""Ranks that wrap different values (seeded differently, weights loaded on one rank)
are refused at wrap, naming the first parameter that differs ([Note: the same values on
every rank] in osdp/runtime/same_values.py); they trained silently (a rep unit's replicas
apart for good, a sharded unit a mix of the ranks' values)."""
from __future__ import annotations

import torch

from . import same_values_cases as sc
from .dist_harness import spawn


def test_ranks_wrapping_different_values_are_refused_naming_the_first():
    results = spawn(sc.run, 2)
    for rank, out in enumerate(results):
        assert out["same"] is None
        assert out["rep"] is not None and "'wte.weight' (and maybe others) on rank(s) [1] differs" in out["rep"]
        assert "sync_module_states=True" in out["rep"]
        assert out["one_tensor"] is not None and "'lm_head.weight'" in out["one_tensor"]
        assert out["meta"] is not None and "'wte.weight'" in out["meta"]
    # the refused model wrapped again with rank 0's values: the replicas agree
    for key, value in results[0]["synced_state"].items():
        torch.testing.assert_close(results[1]["synced_state"][key], value, rtol=0, atol=0, msg=key)
