"""Bad arguments to ``osdp.OSDP`` on a 1-rank gloo group (issue 9): each raises an
OSDPError that says what was given and what would be right, and leaves the model as it
was (same modules, same parameter objects and values, no hooks)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import osdp
import osdp.planner
from osdp.errors import OSDPError
from osdp.models import GPT, GPTConfig, example_batch
from osdp.planner.cluster import load_cluster
from osdp.planner.gpt_desc import describe_gpt
from osdp.planner.planner import make_plan
from osdp.planner.run import RunSettings

CFG = GPTConfig(vocab_size=97, seq_len=8, num_layers=2, hidden=10, heads=2)

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def gpt():
    torch.manual_seed(0)
    return GPT(CFG)


def snapshot(model):
    return {
        "modules": [(name, type(m)) for name, m in model.named_modules()],
        "params": [(name, id(p), p.detach().clone()) for name, p in model.named_parameters()],
        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
                     for m in model.modules()),
    }


def assert_unchanged(model, before):
    after = snapshot(model)
    assert after["modules"] == before["modules"] and after["hooks"] == before["hooks"] == 0
    assert [(n, i) for n, i, _ in after["params"]] == [(n, i) for n, i, _ in before["params"]]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(after["params"], before["params"]))


@pytest.fixture(scope="module")
def plan():
    device = load_cluster("titan-rtx-pcie3").for_run(RunSettings(world_size=1, memory_limit_bytes=2**30))
    return make_plan(describe_gpt(CFG, name="gpt"), device, osdp.planner.PlannerSettings(max_slices=4), batch=2,
                     backend="python")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"splits": 4},
         "splits must be a dict of unit name -> slice count g >= 1, e.g. {'lm_head': 4}, got 4 (an int)"),
        ({"splits": ["lm_head"]},
         "splits must be a dict of unit name -> slice count g >= 1, e.g. {'lm_head': 4}, got ['lm_head'] (a list)"),
        ({"splits": {"blocks.0.mlp.c_fc": 0}}, "splits['blocks.0.mlp.c_fc'] = 0: the slice count must be an integer >= 1"),
        ({"splits": {"blocks.0.mlp.c_fc": -2}}, "splits['blocks.0.mlp.c_fc'] = -2: the slice count must be an integer >= 1"),
        ({"modes": ["dp"]},
         "modes must be a dict of unit name -> 'dp'/'zdp' or one mode per slice, e.g. {'lm_head': 'dp'}, got ['dp'] (a list)"),
        ({"checkpoint_blocks": "blocks.0"},
         "checkpoint_blocks must be a tuple or list of module paths, got the string 'blocks.0': pass ('blocks.0',) for one block"),
        ({"checkpoint_blocks": 3}, "checkpoint_blocks must be a tuple or list of module paths, got 3 (an int)"),
        ({"checkpoint_blocks": (None,)},
         "checkpoint_blocks must list module paths (strings), got None (a NoneType) in (None,)"),
        ({"device": "bogus"}, "device='bogus' is not a device name PyTorch knows; use 'cpu', 'cuda' or 'cuda:<index>'"),
        ({"device": 1.5}, "device must be a torch.device or a string like 'cpu' or 'cuda:0', got 1.5 (a float)"),
        ({"plan": 5}, "plan must be an osdp Plan, the path of a plan JSON file (from `osdp plan --json` or "
                      "Plan.save), or None; got 5 (an int)"),
        ({"plan": "/nonexistent/plan.json"}, "plan file /nonexistent/plan.json does not exist"),
    ],
)
def test_bad_arguments_raise_and_leave_the_model_alone(kwargs, message):
    model = gpt()
    before = snapshot(model)
    with pytest.raises(OSDPError) as info:
        osdp.OSDP(model, **kwargs)
    assert str(info.value) == message
    assert_unchanged(model, before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error():
    model = gpt()
    before = snapshot(model)
    with pytest.raises(OSDPError) as info:
        osdp.OSDP(model, device="cuda")
    why = "this PyTorch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
    assert str(info.value) == (f"device='cuda' but CUDA is not available ({why}): pass device='cpu', or leave "
                               "device unset to use the GPU when there is one")
    assert_unchanged(model, before)


@pytest.mark.parametrize(
    "memory_limit,message",
    [
        (True, "memory_limit: memory size must be a number of bytes or a string with a unit like '8GiB', got True (a bool)"),
        ("8", "memory_limit: memory size '8' has no unit; write it like 8GiB or 8MiB (units: B, KB, MB, GB, TB "
              "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024))"),
        (float("nan"), "memory_limit: memory size must be finite, got nan"),
        (-1, "memory_limit: memory size must be at least 1 byte, got -1"),
    ],
)
def test_bad_memory_limit_in_auto_mode(tmp_path, memory_limit, message):
    model = gpt()
    before = snapshot(model)
    with pytest.raises(OSDPError) as info:
        osdp.OSDP(model, memory_limit=memory_limit, example_inputs=example_batch(CFG, 2),
                  auto_kwargs={"cache_dir": tmp_path})
    assert str(info.value) == message
    assert_unchanged(model, before)
    assert list(tmp_path.iterdir()) == []  # nothing profiled, nothing cached


@pytest.mark.parametrize("as_path", [str, Path], ids=["str", "PathLike"])
def test_plan_given_as_a_path_is_loaded(plan, tmp_path, as_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    from_file = osdp.OSDP(gpt(), plan=as_path(path))
    from_object = osdp.OSDP(gpt(), plan=plan)
    assert from_file.plan == plan
    assert from_file.unit_modes() == from_object.unit_modes()
    assert from_file.batch_size == plan.batch_size == 2


def test_plan_given_as_its_json_dict_is_loaded(plan):
    wrapped = osdp.OSDP(gpt(), plan=json.loads(json.dumps(plan.to_dict())))
    assert wrapped.plan == plan


def test_edited_plan_file_is_refused_before_wrapping(plan, tmp_path):
    data = json.loads(json.dumps(plan.to_dict()))
    data["batch_size"] = 0
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    model = gpt()
    before = snapshot(model)
    with pytest.raises(OSDPError) as info:
        osdp.OSDP(model, plan=str(path))
    assert str(info.value) == f"plan file {path}: plan field 'batch_size' must be an integer >= 1, got 0"
    assert_unchanged(model, before)


# ---- issue 35.5: what a user meets --------------------------------------------------
@pytest.mark.parametrize("given", ["plan", "modes", "splits"])
@pytest.mark.parametrize("auto_only", ["loss_fn", "example_inputs", "settings", "auto_kwargs"])
def test_auto_mode_arguments_without_auto_mode_are_refused(plan, given, auto_only):
    values = {"loss_fn": lambda out: out, "example_inputs": example_batch(CFG, 2),
              "settings": osdp.planner.PlannerSettings(), "auto_kwargs": {"batch": 2}}
    where = {"plan": {"plan": plan}, "modes": {"modes": {"lm_head": "dp"}},
             "splits": {"splits": {"blocks.0.mlp.c_fc": 2}}}[given]
    model = gpt()
    before = snapshot(model)
    with pytest.raises(OSDPError) as info:
        osdp.OSDP(model, **where, **{auto_only: values[auto_only]})
    assert str(info.value) == (f"{auto_only}= is read by auto mode only (memory_limit= and example_inputs= with no "
                               "plan=, modes= or splits=): here it would be ignored; drop it, or plan in auto mode")
    assert_unchanged(model, before)


def test_memory_limit_with_modes_is_the_step_checks_limit():
    from osdp.errors import MemoryLimitExceeded

    wrapped = osdp.OSDP(gpt(), modes={"lm_head": "dp"}, memory_limit="1KiB")
    optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    wrapped(*example_batch(CFG, 2)).backward()
    with pytest.raises(MemoryLimitExceeded):
        optim.step()


def test_a_plan_that_leaves_a_unit_out_is_refused(plan):
    data = json.loads(json.dumps(plan.to_dict()))
    data["units"] = [u for u in data["units"] if u["name"] != "blocks.1.ln_2"]
    model = gpt()
    before = snapshot(model)
    with pytest.raises(OSDPError) as info:
        osdp.OSDP(model, plan=data)
    assert "leaves out 1 module(s) of this model that own parameters ('blocks.1.ln_2')" in str(info.value)
    assert_unchanged(model, before)


def test_hooks_on_a_split_head_still_run_and_the_fused_loss_refuses_to_bypass_them():
    idx, targets = example_batch(CFG, 2)
    plain = osdp.OSDP(gpt(), modes={"lm_head": ("dp", "dp")}, split_ops={"lm_head": "linear_out_features"})
    model = gpt()
    seen = []
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(tuple(out.shape)))  # before wrapping
    hooked = osdp.OSDP(model, modes={"lm_head": ("dp", "dp")}, split_ops={"lm_head": "linear_out_features"})
    with pytest.warns(UserWarning, match="forward hooks of its own: its loss runs on whole logits"):
        loss = hooked(idx, targets)
    assert seen == [(2, CFG.seq_len, CFG.vocab_size)]  # the hook saw the logits
    torch.testing.assert_close(loss, plain(idx, targets), rtol=1e-6, atol=1e-6)  # plain: the fused loss
    with pytest.raises(OSDPError, match="forward hooks of its own, which the fused loss would not run"):
        hooked.module.lm_head.cross_entropy(torch.randn(2, CFG.seq_len, CFG.hidden), targets)
