"""[Note: lockstep check]: ranks whose collectives match in size but carry different
units raise ``RanksOutOfStepError`` out of ``backward()`` on every rank, naming where
they differ, before the optimizer steps; the model then trains on as if that step had
not been taken. Without the check the step ran silently on exchanged gradients."""
from __future__ import annotations

import pytest
import torch

from osdp.errors import RanksOutOfStepError
from osdp.runtime.lockstep_check import IssueLog, out_of_step_message

from . import lockstep_cases as lc
from .dist_harness import spawn


@pytest.mark.parametrize("wrap", [{}, {"default_mode": "dp", "coalesce_bytes": 0}], ids=["zdp-coalesced", "dp"])
def test_ranks_out_of_step_raise_and_the_model_trains_on(wrap):
    results = spawn(lc.run, 2, True, wrap)
    reference = lc.reference()
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} did not raise"
        assert "'layers.2'" in r["error"] and "'layers.1'" in r["error"], r["error"]
        for key, value in reference.items():
            torch.testing.assert_close(r["state"][key], value, rtol=1e-6, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_check_off_lets_the_step_run():
    """lockstep_check=False: no error (the step ran on wrong gradients: the states no
    longer match the reference)."""
    results = spawn(lc.run, 2, False)
    assert all(r["error"] is None for r in results)
    reference = lc.reference()
    assert any(not torch.allclose(results[0]["state"][k], v, atol=1e-6) for k, v in reference.items())


def test_issue_log_hash_sees_order_size_and_every_member():
    def value(*notes):
        log = IssueLog()
        for note in notes:
            log.note(*note)
        return log.value()

    a, b = ("all-gather of unit 'a'", 10), ("all-gather of unit 'b'", 10)
    assert value(a, b) == value(a, b)
    assert value(a, b) != value(b, a)
    assert value(a) != value(("all-gather of unit 'a'", 11))
    assert value() == 0 and value(a) != 0
    five = ("coalesced all-gather of 5 units ('u0', 'u1', 'u2', 'u3', ...)", 50)
    assert value((*five, ("u0", "u1", "u2", "u3", "u4"))) != value((*five, ("u0", "u1", "u2", "u3", "u5")))


def test_message_names_the_first_difference():
    logs = [["x (1 elements)", "all-gather of unit 'a' (4 elements)"],
            ["x (1 elements)", "all-gather of unit 'b' (4 elements)"]]
    text = out_of_step_message(logs, 1)
    assert text.startswith("rank 1:")
    assert "collective 1 of the step, rank 0: all-gather of unit 'a'" in text
    assert "rank 1: all-gather of unit 'b'" in text and "lockstep_check=False" in text
    shorter = out_of_step_message([["x (1 elements)"], ["x (1 elements)", "y (2 elements)"]], 0)
    assert "rank 0: nothing more" in shorter
    assert issubclass(RanksOutOfStepError, Exception)
