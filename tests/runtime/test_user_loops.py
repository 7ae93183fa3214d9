"""Idioms of users' own training loops on 2 gloo ranks, against the plain model trained
on the whole global batch in each rank (``user_loop_cases.py``). Tolerances as the
parity tests: losses rtol 1e-5, parameters 1e-5 (fp32, AdamW eps 1e-5)."""
from __future__ import annotations

import pytest
import torch

from . import user_loop_cases as uc
from .dist_harness import spawn

WORLD = 2
_RESULTS: dict = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not _RESULTS:
        _RESULTS.update(spawn(uc.run_all, WORLD, str(tmp_path_factory.mktemp("ckpt")))[0])
    return _RESULTS


def _same_training(run):
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(run["expected"]), rtol=1e-5, atol=0)
    assert run["params"] < 1e-5


@pytest.mark.parametrize("config", ["dp", "zdp", "random", "split"])
def test_a_metric_forward_between_backward_and_step_changes_nothing(results, config):
    """Before the fix, dp units reused the weights gathered before the step: every
    update a step late (parameters 3.4e-2 off)."""
    _same_training(results["metric_forward"][config])


@pytest.mark.parametrize("config", ["dp", "zdp"])
def test_a_backward_through_a_forward_before_the_step_is_refused_as_plain_pytorch_does(results, config):
    out = results["late_backward"]
    assert "modified by an inplace operation" in out["plain"]
    run = out[config]
    assert run["raised"].startswith("OSDPError: backward through unit ") and "modified in place" in run["raised"]
    assert run["params"] < 1e-5  # the loop went on as the plain one did


@pytest.mark.parametrize("config", ["dp", "zdp", "split"])
def test_a_forward_before_a_checkpoint_load_computes_with_the_loaded_weights_after(results, config):
    assert results["forward_before_load"][config] < 1e-5


def test_param_groups_built_in_another_order_take_their_own_hyperparameters_on_load(results):
    """Before the fix groups were matched by position: the matrices' weight decay went
    to the biases and norms."""
    run = results["groups_reordered"]
    assert [(name, decay) for name, decay, _ in run["groups"]] == [("no_decay", 0.0), ("decay", 0.1)]
    _same_training(run)
    assert "its param group 0 holds" in run["refused"] and "which no param group of the checkpoint" in run["refused"]


def test_torch_dcp_and_shape_reading_optimizers_are_refused_not_silently_wrong(results):
    """Before: DCP saved rank 0's pieces for every rank; Adafactor divided by zero on an
    empty piece, LBFGS and Muon stepped pieces to other values."""
    run = results["refused_tools"]
    for call in ("get_state_dict", "dcp.save(Stateful)"):
        assert run[call].startswith("torch.distributed.checkpoint called model.state_dict()"), call
        assert "osdp.checkpoint.save(model, optimizer, path)" in run[call]
    for optimizer in ("Adafactor", "LBFGS"):
        assert run[optimizer].startswith(f"torch.optim.{optimizer} steps each parameter as a whole"), optimizer
        assert "piece of a (" in run[optimizer] and "modes={unit: 'rep'}" in run[optimizer]
    assert run["Adafactor on rep units"] == "stepped"


@pytest.mark.parametrize("config", ["dp", "zdp", "random", "split"])
def test_a_micro_batch_under_no_sync_dropped_by_model_zero_grad_is_gone(results, config):
    """Before the fix its gradients were added into the next synced backward's."""
    _same_training(results["no_sync_discarded"][config])


@pytest.mark.parametrize("config", ["dp", "zdp", "random", "split"])
def test_a_step_while_no_sync_gradients_are_held_is_refused(results, config):
    run = results["step_while_held"][config]
    assert run["raised"].startswith("optimizer.step() while ") and "model.zero_grad() to drop them" in run["raised"]
    assert run["params"] < 1e-5  # dropped, then trained as the plain model without that batch


@pytest.mark.parametrize("config", ["split_in", "split_out"])
def test_an_input_gradient_through_split_ops_leaves_grad_alone(results, config):
    """FGSM: the input's gradient by autograd.grad, then a step on the perturbed input.
    Before the fix the split slices' weight gradients of the first pass reached .grad
    (parameters 0.147 off)."""
    run = results["input_gradient"][config]
    assert run["grads_after_input_grad"] == []
    _same_training(run)
