"""What a real training loop does with a wrapped model, on 2 gloo ranks against
single-process training of the same model on the whole global batch: optimizer param
groups built from the original parameter names (weight decay off for biases and norms),
global gradient clipping every step, an exception inside forward before the first step
and one inside backward later (each caught, then training goes on), and every attempt
to wrap a module the first wrapper owns refused. Tolerances as the parity tests (fp32,
AdamW eps=1e-5): losses and gradient norms rtol 1e-5, parameters rtol/atol 1e-5."""
from __future__ import annotations

import pytest
import torch

import osdp
from osdp.errors import OSDPError

from . import training_loop_cases as tc
from .dist_harness import spawn

WORLD = 2
_RESULTS: dict = {}


def results():
    if not _RESULTS:
        _RESULTS["ref"] = tc.reference(WORLD)
        _RESULTS["osdp"] = spawn(tc.osdp_run, WORLD)
    return _RESULTS["ref"], _RESULTS["osdp"]


def test_global_grad_norm_is_the_single_process_norm_on_every_rank():
    (_, ref_norms, _, _), runs = results()
    for run in runs:
        # 2-norm (clipping), 1-norm and inf-norm, every step
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    assert runs[0]["norms"] == runs[1]["norms"], "every rank must clip by the same norm"
    assert all(n[0] > tc.MAX_NORM for n in ref_norms), "the test must clip every step"


def test_torch_clip_grad_norm_gives_the_global_norm():
    """torch.nn.utils.clip_grad_norm_ and get_total_norm over an OSDP model's gradients
    (what accelerate, so Hugging Face's Trainer, calls) give the single process's norms
    (2, 1 and inf) on every rank; they were refused, pointing to model.clip_grad_norm_
    ([Note: global gradient norm] in osdp/runtime/grad_norm.py)."""
    (_, ref_norms, _, _), runs = results()
    for run in runs:
        assert run["torch_clip"] == pytest.approx(ref_norms[1], rel=1e-5)


def test_param_groups_by_name_clipping_and_exceptions_train_like_single_process():
    (ref_losses, _, ref_state, ref_evals), runs = results()
    run = runs[0]
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(run["evals"]), torch.tensor(ref_evals), rtol=1e-5, atol=0)
    assert list(run["state"]) == list(ref_state)
    for key in ref_state:
        torch.testing.assert_close(run["state"][key], ref_state[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    for r in runs:
        assert r["stats_after"] == [], "nothing stays gathered after the recovered steps"


def test_parameters_keep_original_names_and_ndim():
    _, runs = results()
    names = runs[0]["names"]
    assert "blocks.0.ln_1.bias" in names and "lm_head.weight" in names and "wte.weight" in names
    assert len(names) == len(set(names)), "each parameter once, the split wte too"
    assert not any("flat_shard" in n or n.startswith("module.") for n in names)
    assert all(r["ndim_rule_agrees"] for r in runs)


def test_second_wrapper_is_refused_before_anything_changes():
    _, runs = results()
    for message in runs[0]["refused"]:
        assert "already wrapped by osdp.OSDP" in message, message
    # and the first wrapper trained afterwards like single process (test above)


pytestmark_single = pytest.mark.usefixtures("one_rank_group")


@pytestmark_single
def test_state_dict_has_original_keys_and_round_trips():
    from . import parity_cases as pc

    plain = pc.make_model("tied")
    keys = list(plain.state_dict())
    model = osdp.OSDP(pc.make_model("tied"), splits={"blocks.0.mlp.c_fc": 2})
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert list(state) == keys  # tied names both present, the split weight once, like the plain state dict
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.load_state_dict(state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    with pytest.raises(OSDPError, match="missing"):
        model.load_state_dict({k: v for k, v in state.items() if k != "wpe.weight"})
    wrong = dict(state, **{"wpe.weight": plain.wpe.weight.detach()})
    with pytest.raises(OSDPError, match="load_full_state_dict"):
        model.load_state_dict(wrong)
