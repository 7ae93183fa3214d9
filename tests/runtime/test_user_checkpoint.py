"""Activation checkpointing in the user's own forward (``torch.utils.checkpoint``, as
Hugging Face's ``gradient_checkpointing_enable`` and older model code write it) around
OSDP's units, on 2 gloo ranks: a reentrant checkpoint runs its region without grad and
then the backward of the recomputed graph ([Note: activation checkpointing] in
osdp/runtime/scheduler.py); a non-reentrant one the original graph's. Both train as
single-process training of the same model does: split (dp, zdp) slices, dp, rep and
frozen units, a tied head, regions that hold every unit but the embedding lookup;
and a stock GPT-2 under Hugging Face's ``gradient_checkpointing_enable`` (both kinds)."""
from __future__ import annotations

import pytest

from runtime.dist_harness import spawn
from runtime.user_checkpoint_cases import run_user_checkpoint

CASES = [("blocks", True), ("blocks", False), ("cover", True), ("cover", False), ("hf_gpt2", True),
         ("hf_gpt2", False)]


@pytest.fixture(scope="module")
def results():
    return spawn(run_user_checkpoint, 2, CASES)


@pytest.mark.parametrize("name", ["blocks-reentrant", "blocks-non_reentrant", "cover-reentrant",
                                  "cover-non_reentrant", "hf_gpt2-reentrant", "hf_gpt2-non_reentrant"])
def test_user_checkpointing_trains_as_single_process(results, name):
    for rank in results:
        r = rank[name]
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6, abs=1e-6), r
        assert r["param_err"] <= 1e-5, r["param_err"]
        assert r["gathered_after"] == [], "every gathered buffer freed after the step"
