"""Example inputs and the profiling loss ([Note: example inputs and the loss] in
osdp/planner/inputs.py): normalization, batch resizing, loss extraction, and describe
running a stock Hugging Face model through its keyword forward (one process)."""
import gc
import logging
import weakref
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from osdp.errors import OSDPError
from osdp.planner.description import describe
from osdp.planner.inputs import AssumedLoss, ExampleInputs, as_example_inputs, auto_mode_loss, loss_of
from osdp.profiler.hardware import time_units


def test_forms_of_example_inputs():
    x, y = torch.zeros(4, 3), torch.ones(4)
    assert as_example_inputs((x, y)) == ExampleInputs((x, y), {})
    assert as_example_inputs([x]).args == (x,)
    assert as_example_inputs(x).args == (x,)
    kw = as_example_inputs({"input_ids": x, "labels": y})
    assert kw.args == () and list(kw.kwargs) == ["input_ids", "labels"]
    both = as_example_inputs(ExampleInputs((x,), {"labels": y}))
    assert both.args == (x,) and both.kwargs["labels"] is y
    with pytest.raises(OSDPError, match="keyword arguments.*keys must be parameter names"):
        as_example_inputs({0: x})
    with pytest.raises(OSDPError, match="tuple of positional arguments, a dict of keyword arguments"):
        as_example_inputs(3)


def test_batch_is_dim0_of_the_first_tensor_and_resizing_keeps_flags():
    inputs = as_example_inputs({"use_cache": False, "input_ids": torch.arange(8).view(4, 2),
                                "mask": torch.ones(2, 2), "labels": torch.arange(4)})
    assert inputs.batch_size() == 4
    small = inputs.with_batch(2)
    assert small.kwargs["use_cache"] is False
    assert small.kwargs["input_ids"].tolist() == [[0, 1], [2, 3]]
    assert small.kwargs["mask"].shape == (2, 2), "a tensor of another leading size is not a batch"
    assert small.kwargs["input_ids"].untyped_storage().data_ptr() != inputs.kwargs["input_ids"].untyped_storage().data_ptr()
    big = inputs.with_batch(6)
    assert big.kwargs["labels"].tolist() == [0, 1, 2, 3, 0, 1]
    with pytest.raises(OSDPError, match="batch dimension"):
        as_example_inputs({"use_cache": False}).batch_size()



class _BatchDictNet(nn.Module):
    """``model(batch)`` with the batch a dict (a vision loop's idiom), returning its loss."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 10)

    def forward(self, batch):
        h = torch.relu(self.conv(batch["image"])).mean((2, 3))
        return F.cross_entropy(self.head(h), batch["pair"][1])


def test_the_batch_inside_a_dict_or_tuple_argument_is_found_and_resized():
    """A positional dict (or list, tuple) of tensors: its first tensor is the batch, and
    every tensor in it with that dim 0 is cut or repeated, as top-level ones are."""
    image, labels, table = torch.randn(4, 3, 6, 6), torch.arange(4), torch.ones(5, 2)
    batch = {"image": image, "pair": (table, labels), "flag": True}
    inputs = as_example_inputs((batch,))
    assert inputs.batch_size() == 4
    assert [t.shape for t in inputs.tensors()] == [image.shape, table.shape, labels.shape]
    small = inputs.with_batch(2).args[0]
    assert small["image"].shape == (2, 3, 6, 6) and small["pair"][1].tolist() == [0, 1]
    assert small["pair"][0] is table and small["flag"] is True, "not the batch: as it is"
    assert inputs.with_batch(6).args[0]["pair"][1].tolist() == [0, 1, 2, 3, 0, 1]
    with pytest.raises(OSDPError, match=r"batch dimension.*got \(\{'flag': bool\}\)"):
        as_example_inputs(({"flag": True},)).batch_size()
    torch.manual_seed(0)
    desc = describe(_BatchDictNet(), (batch,))  # its backward at 4 and at the halved 2
    assert [op.name for op in desc.ops] == ["conv", "head"] and desc.ops[0].act_bytes_per_sample > 0
    with torch.device("meta"):
        meta = _BatchDictNet()
    assert describe(meta, (batch,)) == desc, "described on fake tensors: the same"

class _Output(OrderedDict):
    """A dict with attribute access, like transformers' ModelOutput."""

    def __getattr__(self, name):
        return self.get(name)


def test_loss_of_each_output_kind():
    scalar, logits = torch.tensor(2.0), torch.ones(2, 3)
    assert loss_of(scalar) is scalar
    assert loss_of(logits).item() == 6.0
    assert loss_of(_Output(loss=scalar, logits=logits)) is scalar
    assert loss_of({"loss": scalar}) is scalar
    assert loss_of((logits,), loss_fn=lambda out: out[0].sum()).item() == 6.0
    with pytest.raises(OSDPError, match=r"_Output\) has no loss: put the targets in example_inputs.*labels"):
        loss_of(_Output(logits=logits))
    with pytest.raises(OSDPError, match="returned a tuple.*pass loss_fn="):
        loss_of((logits,))
    with pytest.raises(OSDPError, match=r"must return a scalar tensor, got a tensor of shape \(2, 3\)"):
        loss_of((logits,), loss_fn=lambda out: out[0])


class _TupleNet(nn.Module):
    """Keyword-only targets and a tuple output: needs example_inputs as a dict + loss_fn."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, *, x, scale=1.0):
        h = self.fc1(x)
        return (self.fc2(torch.relu(h)) * scale, h)


def test_describe_and_timing_run_backward_on_loss_fn_for_every_batch():
    seen = []

    def loss_fn(out):
        seen.append(out[0].shape[0])
        return out[0].square().mean()

    model = _TupleNet()
    inputs = {"x": torch.randn(4, 8), "scale": 0.5}
    desc = describe(model, inputs, loss_fn=loss_fn)
    assert [op.name for op in desc.ops] == ["fc1", "fc2"]
    assert seen == [4, 2], "backward measured at the example batch and at its half"
    assert all(p.grad is None for p in model.parameters()), "describe leaves no gradients behind"
    seen.clear()
    times = time_units(model, as_example_inputs(inputs).with_batch(3), desc, loss_fn, repeats=1)
    assert set(times) == {"fc1", "fc2"} and seen == [3, 3]
    with pytest.raises(OSDPError, match="returned a tuple.*pass loss_fn="):
        describe(model, inputs)


def test_a_loss_fn_bound_to_the_example_batch_is_told_why_it_fails():
    targets = torch.randn(4, 8)
    with pytest.raises(OSDPError, match="forward of 2 samples.*must work for any batch"):
        describe(_TupleNet(), {"x": torch.randn(4, 8)}, loss_fn=lambda out: (out[0] - targets).square().mean())



def test_a_loss_fn_bound_to_real_targets_on_a_meta_model_is_told_why_it_fails():
    """A meta-built model is described on fake tensors: real targets in a closure fail at
    once, even at the example batch, and the error says so rather than fake tensor mode's."""
    targets = torch.randn(4, 8)
    with torch.device("meta"):
        model = _TupleNet()
    with pytest.raises(OSDPError, match="described on fake tensors.*compute from the output alone"):
        describe(model, {"x": torch.randn(4, 8)}, loss_fn=lambda out: (out[0] - targets).square().mean())
    # computed from the output alone, the same loss_fn shape describes
    desc = describe(model, {"x": torch.randn(4, 8)}, loss_fn=lambda out: out[0].square().mean())
    assert [op.name for op in desc.ops] == ["fc1", "fc2"]

def test_describe_a_stock_hugging_face_model_with_keyword_inputs():
    transformers = pytest.importorskip("transformers")
    from osdp.models.hf import GPT2_DEFAULTS

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_DEFAULTS))
    x = torch.randint(0, 97, (4, 8))
    desc = describe(model, {"input_ids": x, "labels": x})  # backward on output.loss
    assert desc.ops[0].name == "transformer.wte" and desc.op_index("transformer.h.1.mlp.c_proj") > 0
    assert any(op.act_grad_bytes_per_sample > 0 for op in desc.ops), "the backward was measured"
    with pytest.raises(OSDPError, match="has no loss: put the targets in example_inputs"):
        describe(model, {"input_ids": x})


def test_auto_mode_assumes_a_cross_entropy_over_logits_says_so_once_and_keeps_the_other_rules(caplog):
    """[Note: example inputs and the loss]: no loss_fn, an output with a class dimension:
    auto mode runs a cross-entropy over the last dimension, the output held as long as
    the loss (the loop's ``logits``); scalars, ``.loss`` and class-less outputs as before."""
    given = lambda out: out.sum()  # noqa: E731
    assert auto_mode_loss(given) is given
    assumed = auto_mode_loss(None)
    assert isinstance(assumed, AssumedLoss) and assumed.assumed == ""
    scalar = torch.tensor(2.0)
    assert assumed(scalar) is scalar
    assert assumed(_Output(loss=scalar, logits=torch.ones(2, 3))) is scalar
    assert assumed(torch.ones(4, 1)).item() == 4.0, "no class dimension: the sum, as before"
    assert assumed(torch.ones(4, dtype=torch.float64)).item() == 4.0
    with pytest.raises(OSDPError, match="returned a tuple.*pass loss_fn="):
        assumed((torch.ones(2, 3),))
    assert assumed.assumed == "", "nothing assumed yet: every output so far had a rule"

    logits = torch.randn(2, 5, 7, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="osdp.auto"):
        out = logits * 1.0
        held = weakref.ref(out)
        loss = assumed(out)
        want = F.cross_entropy(logits.detach().view(10, 7), torch.zeros(10, dtype=torch.long))
        torch.testing.assert_close(loss, want)
        del out
        gc.collect()
        assert held() is not None, "the output lives as long as the loss, as the loop's logits"
        loss.backward()
        assert held() is not None, "... through backward"
        del loss
        gc.collect()
        assert held() is None
        assumed(torch.randn(3, 7, requires_grad=True)).backward()  # a second guess is not announced again
    assert "cross_entropy over the last dimension" in assumed.assumed and "7 classes" in assumed.assumed
    records = [r for r in caplog.records if r.name == "osdp.auto"]
    assert len(records) == 1 and "loss_fn=" in records[0].getMessage()
    assert assumed.assumed in records[0].getMessage()
    caplog.clear()
    quiet = AssumedLoss(announce=False)  # the ranks other than 0
    with caplog.at_level(logging.INFO, logger="osdp.auto"):
        quiet(torch.randn(3, 7, requires_grad=True))
    assert quiet.assumed and not caplog.records



def test_auto_mode_assumes_a_cross_entropy_over_the_logits_of_an_output_without_a_loss():
    """A Hugging Face model called without ``labels=`` (the loop computes its own loss from
    ``out.logits``): auto mode prices a cross-entropy over the logits, holding the whole
    output; an output with a loss keeps it, one without logits with classes is refused."""
    assumed = AssumedLoss(announce=False)
    logits = torch.randn(2, 5, 7, requires_grad=True)
    cache = torch.randn(2, 5, 3)
    out = _Output(logits=logits * 1.0, past=cache)
    loss = assumed(out)
    want = F.cross_entropy(logits.detach().reshape(10, 7), torch.zeros(10, dtype=torch.long))
    torch.testing.assert_close(loss, want)
    assert "the output's logits (7 classes" in assumed.assumed
    held = loss.grad_fn.metadata["osdp_held_output"]
    assert any(v is cache for v in held) and any(v is out["logits"] for v in held), "the whole output is held"
    scalar = torch.tensor(2.0)
    assert AssumedLoss(announce=False)(_Output(loss=scalar, logits=logits)) is scalar
    with pytest.raises(OSDPError, match=r"_Output\) has no loss"):
        AssumedLoss(announce=False)(_Output(logits=torch.randn(4, 1)))

class _Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(16, 8), nn.Linear(8, 500)  # logits far above the head's weights

    def forward(self, x):
        return self.head(torch.relu(self.fc(x)))


def test_describe_prices_the_assumed_loss_at_the_head_not_a_free_sum():
    """The sum's gradient is a broadcast scalar: its loss's moment holds nothing beside
    the held logits. The assumed cross-entropy's holds the log-probabilities it saved,
    their gradient and the logits' beside them: nearly 3 logits more."""
    torch.manual_seed(0)
    model, x = _Logits(), torch.randn(64, 16)
    summed = describe(model, (x,))
    assumed = describe(model, (x,), loss_fn=AssumedLoss(announce=False))
    logits_per_sample = 500 * 4
    extra = assumed.loss_bytes_per_sample - summed.loss_bytes_per_sample  # [Note: the loss's moment]
    assert extra >= 2.5 * logits_per_sample, (extra, logits_per_sample)
    assert [op.act_bytes_per_sample for op in assumed.ops] == [op.act_bytes_per_sample for op in summed.ops]


def test_every_loss_holds_the_output_as_long_as_it_lives_and_frees_it_without_a_cycle():
    """A loop's ``out = model(...)`` holds the output through backward and the optimizer
    step: describe and the runtime's measurement hold it as long as the loss, for every
    rule; kept on the loss's node without the loss (no cycle: freed by reference
    counting, the garbage collector off)."""
    y = torch.randn(4, 3, requires_grad=True)
    cases = [
        (lambda logits: _Output(loss=(logits * logits).mean(), logits=logits), None),  # .loss
        (lambda logits: logits, None),  # the sum
        (lambda logits: (logits, logits.detach()), lambda out: out[0].mean()),  # loss_fn of a tuple
    ]
    gc.disable()
    try:
        for make_output, loss_fn in cases:
            logits = y * 2.0
            held = weakref.ref(logits)
            loss = loss_of(make_output(logits), loss_fn)
            del logits
            assert held() is not None
            loss.backward()
            assert held() is not None
            del loss
            assert held() is None
        scalar = (y * 2.0).sum()  # the output is the loss: nothing beside it to hold
        assert loss_of(scalar) is scalar and "osdp_held_output" not in scalar.grad_fn.metadata
    finally:
        gc.enable()


def test_the_measured_plan_cache_keys_a_batch_dict_by_shapes_not_values():
    """[Note: measured plan cache]: inputs in a container key by their structure, shapes
    and dtypes; flat inputs keep the keys they had."""
    from osdp.measured_plans import _inputs_signature

    def key(image, labels):
        return _inputs_signature(({"image": image, "labels": labels},))

    assert key(torch.zeros(4, 3), torch.arange(4)) == key(torch.ones(4, 3), torch.arange(4) + 1)
    assert key(torch.zeros(4, 3), torch.arange(4)) != key(torch.zeros(2, 3), torch.arange(2))
    assert _inputs_signature((torch.zeros(4, 3),)) == [["0", [4, 3], "torch.float32"]]
    assert _inputs_signature({"use_cache": False}) == [["use_cache", "False"]]



class _PackedPatches(nn.Module):
    """A vision-language shape: ``patches`` holds every sample's 3 patches packed along
    dim 0 (Qwen2-VL's ``pixel_values``), so its dim 0 is not the batch."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.vision = nn.Linear(2, 4)

    def forward(self, ids, patches):
        images = self.vision(patches).view(ids.shape[0], 3, 4).mean(1)
        return (self.embed(ids).mean(1) + images).sum()


def _packed(batch: int) -> dict:
    gen = torch.Generator().manual_seed(batch)
    return {"ids": torch.randint(0, 10, (batch, 5), generator=gen), "patches": torch.randn(3 * batch, 2, generator=gen)}


def test_packed_inputs_resize_through_at_batch_and_without_it_the_failure_names_them():
    model = _PackedPatches()
    plain = as_example_inputs(_packed(4))
    with pytest.raises(OSDPError, match=r"at batch 2 failed .*passed as given: patches \(12, 2\).*at_batch=fn"):
        plain.with_batch(2).call(model)
    assert plain.with_batch(4).kept_as_given == ()  # the example batch itself runs as given
    packed = as_example_inputs(ExampleInputs((), _packed(4), at_batch=_packed))
    for batch in (1, 3, 8):
        resized = packed.with_batch(batch)
        assert resized.kwargs["patches"].shape == (3 * batch, 2) and resized.at_batch is _packed
        resized.call(model)
    asked = []
    describe(model, ExampleInputs((), _packed(4), at_batch=lambda n: asked.append(n) or _packed(n)))
    assert asked == [2]  # describe's second point, at half the batch
    with pytest.raises(OSDPError, match=r"at_batch\(2\) returned inputs of batch 4"):
        as_example_inputs(ExampleInputs((), _packed(4), at_batch=lambda n: _packed(4))).with_batch(2)
    with pytest.raises(OSDPError, match="at_batch must be a function of the batch size"):
        as_example_inputs(ExampleInputs((), _packed(4), at_batch=8))
