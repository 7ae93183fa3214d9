"""Leaf modules in one process (a 1-rank gloo group): a module made one unit of every
parameter below it ([Note: leaf modules] in osdp/module_tree.py). Against the plain
model: training, a meta-device build, checkpoints read into another unit layout; and
the errors of leaves that cannot be. Two ranks routing differently:
test_lockstep_moe.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import osdp
import osdp.checkpoint as ckpt
from osdp.contract import RuntimeConfig
from osdp.errors import OSDPError, PlanMismatchError
from osdp.planner import PlannerSettings

from . import lockstep_moe_cases as mc

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def _steps(model, steps=3):
    """AdamW steps of the user's own loss; the losses."""
    optim = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    losses = []
    for step in range(steps):
        data = mc.batch(step, 1)
        loss = nn.functional.cross_entropy(model(data["x"]), data["y"])
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kwargs", [{"leaf_modules": (mc.SkippingMoE,)},
                                    {"leaf_modules": ("moe.1", "moe.0"), "default_mode": "dp"},
                                    {"leaf_modules": (mc.SkippingMoE,), "modes": {"moe.0": "rep"}}])
def test_leaf_trains_as_the_plain_model(kwargs):
    model = osdp.OSDP(mc.build(mc.SkippingMoE), **kwargs)
    reference = mc.build(mc.MoE)  # every expert called: zero gradients where unrouted, as a leaf gets
    assert _steps(model) == pytest.approx(_steps(reference), rel=1e-6)
    state = model.full_state_dict(rank0_only=False)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_leaf_names_its_parameters_as_the_model_does():
    model = osdp.OSDP(mc.build(mc.SkippingMoE), leaf_modules=(mc.SkippingMoE,))
    plain = mc.build(mc.SkippingMoE)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert model.unit_names() == ["inp", "moe.0", "moe.1", "head"]
    assert [n for n in model.state_dict()] == [n for n in plain.state_dict()]


def test_meta_build_of_a_leaf_equals_the_cpu_build():
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = mc.Net(mc.SkippingMoE)
    model = osdp.OSDP(meta, leaf_modules=(mc.SkippingMoE,))
    assert not any(p.is_meta for p in model.parameters())
    state = model.full_state_dict(rank0_only=False)
    for key, value in mc.build(mc.SkippingMoE).state_dict().items():
        assert torch.equal(state[key], value), key


def test_checkpoint_of_leaves_loads_into_units_per_expert(tmp_path):
    """A checkpoint names original parameters, not units: saved with leaves, loaded
    into a unit per expert, with the optimizer state."""
    leafy = osdp.OSDP(mc.build(mc.SkippingMoE), leaf_modules=(mc.SkippingMoE,), default_mode="dp")
    optim = torch.optim.AdamW(leafy.parameters(), lr=0.05)
    for step in range(2):
        data = mc.batch(step, 1)
        nn.functional.cross_entropy(leafy(data["x"]), data["y"]).backward()
        optim.step()
        optim.zero_grad()
    ckpt.save(leafy, optim, str(tmp_path / "c"), step=2)
    per_expert = osdp.OSDP(mc.build(mc.MoE))
    optim2 = torch.optim.AdamW(per_expert.parameters(), lr=0.05)
    ckpt.load(per_expert, optim2, str(tmp_path / "c"))
    want, got = leafy.full_state_dict(rank0_only=False), per_expert.full_state_dict(rank0_only=False)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    data = mc.batch(2, 1)
    assert torch.equal(leafy(data["x"]), per_expert(data["x"]))


def test_plan_names_a_leaf_as_its_unit():
    """A plan whose unit owns no parameters itself is a leaf: the runtime runs it so."""
    model = mc.build(mc.SkippingMoE)
    modes = {"inp": ("zdp",), "moe.0": ("dp",), "moe.1": ("rep",), "head": ("zdp",)}
    counts = {"inp": 8 * 16 + 16, "moe.0": 16 * 4 + 4 + 4 * (16 * 16 + 16), "head": 16 * 3 + 3}
    counts["moe.1"] = counts["moe.0"]
    run = RuntimeConfig(unit_modes=modes, world_size=1, unit_param_bytes={k: 4 * v for k, v in counts.items()})
    wrapped = osdp.OSDP(model, run)
    assert wrapped.unit_modes() == {"inp": "zdp", "moe.0": "dp", "moe.1": "rep", "head": "zdp"}
    with pytest.raises(PlanMismatchError, match=r"leaf_modules= resolves to \['moe.0'\].*plan's leaf units are"):
        osdp.OSDP(mc.build(mc.SkippingMoE), run, leaf_modules=("moe.0",))


class _TiedAcross(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 10, bias=False))
        self.block[1].weight = self.emb.weight

    def forward(self, idx):
        return self.block(self.emb(idx))


@pytest.mark.parametrize("make,kwargs,match", [
    (lambda: mc.build(mc.SkippingMoE), {"leaf_modules": "moe.0"}, r"tuple or list .* pass \('moe.0',\)"),
    (lambda: mc.build(mc.SkippingMoE), {"leaf_modules": ("moe.2",)}, r"'moe.2' is not a module path.*'moe.0'"),
    (lambda: mc.build(mc.SkippingMoE), {"leaf_modules": (nn.Conv2d,)}, r"no module of Net is a Conv2d"),
    (lambda: mc.build(mc.SkippingMoE), {"leaf_modules": (3,)}, r"module classes .* or module paths .* got 3"),
    (lambda: mc.build(mc.SkippingMoE), {"leaf_modules": ("",)}, r"the whole model cannot be one leaf"),
    (lambda: mc.build(mc.SkippingMoE), {"leaf_modules": (mc.SkippingMoE,), "splits": {"moe.0": 2}},
     r"'moe.0' is a leaf module, gathered whole"),
    (lambda: mc.build(mc.SkippingMoE), {"leaf_modules": (mc.SkippingMoE,), "modes": {"moe.0": ("dp", "zdp")}},
     r"'moe.0' is a leaf module, gathered whole: give it one mode"),
    (lambda: mc.build(mc.SkippingMoE), {"leaf_modules": (mc.SkippingMoE,), "modes": {"moe.0.experts.1": "dp"}},
     r"'moe.0.experts.1' is inside leaf module 'moe.0', which is one unit"),
    (lambda: mc.build(mc.SkippingMoE), {"modes": {"moe.0": "dp"}},
     r"or make it one unit with leaf_modules=\('moe.0',\)"),
    (_TiedAcross, {"leaf_modules": ("block",)}, r"'1.weight' is also 'emb.weight', outside it"),
])
def test_bad_leaves_are_refused_before_the_model_changes(make, kwargs, match):
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OSDPError, match=match):
        osdp.OSDP(model, **kwargs)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())


def test_describe_prices_a_leaf_as_the_sum_of_its_parts():
    """Every expert called (so the per-module description runs the same code): the
    leaf's parameters, FLOPs and saved bytes are those of the units inside it."""
    from osdp.planner import describe

    data = mc.batch(0, 2)
    inputs = (data["x"],)
    loss = lambda out: out.square().mean()  # noqa: E731
    parts = describe(mc.build(mc.MoE), inputs, loss_fn=loss)
    whole = describe(mc.build(mc.MoE), inputs, loss_fn=loss, leaf_modules=(mc.MoE,))
    assert [op.name for op in whole.ops] == ["inp", "moe.0", "moe.1", "head"]
    for leaf in ("moe.0", "moe.1"):
        inside = [op for op in parts.ops if op.name.startswith(leaf + ".")]
        op = whole.ops[whole.op_index(leaf)]
        assert op.param_count == sum(o.param_count for o in inside) == 4 * (16 * 16 + 16) + 16 * 4 + 4
        assert op.tensor_numels == tuple(n for o in inside for n in o.tensor_numels)
        assert op.flops_per_sample == pytest.approx(sum(o.flops_per_sample for o in inside))
        assert op.act_bytes_per_sample == pytest.approx(sum(o.act_bytes_per_sample for o in inside))
        assert not op.splittable and op.kind == "moe"
    # the blocks: moe.0 and moe.1, each one unit now, with the same inputs
    assert [(b.name, b.num_ops, b.input_bytes_per_sample) for b in whole.blocks] == [
        (b.name, 1, b.input_bytes_per_sample) for b in parts.blocks if b.name in ("moe.0", "moe.1")]


# ---- weights read outside their unit ([Note: weights read outside their unit]) ------------
class _ReadsChild(nn.Module):
    """As stock Mamba's mixer: computes with a child's weight itself (``calls_child``:
    after calling the child, as code that reuses a projection's weight does)."""

    def __init__(self, calls_child: bool):
        super().__init__()
        self.calls_child = calls_child
        self.child = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        y = self.child(x) * self.scale if self.calls_child else x * self.scale
        return y + x.to(self.child.weight.dtype) @ self.child.weight.t()  # a metadata read, then the weight


class _ReadsChildNet(nn.Module):
    def __init__(self, calls_child: bool):
        super().__init__()
        self.inner = _ReadsChild(calls_child)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.inner(x)))


def _reads_child_net(calls_child: bool) -> _ReadsChildNet:
    torch.manual_seed(0)
    return _ReadsChildNet(calls_child)


@pytest.mark.parametrize("calls_child", [False, True])
@pytest.mark.parametrize("mode", ["zdp", "dp"])
def test_a_weight_read_outside_its_unit_names_the_leaf_that_works(calls_child, mode):
    """The first forward raises, naming the weight, the reading module and the
    ``leaf_modules=`` that works (it failed deep inside the model: a freed buffer, or in
    backward on a gradient of the wrong size); with that leaf the model trains as the
    plain one."""
    model = osdp.OSDP(_reads_child_net(calls_child), default_mode=mode)
    with pytest.raises(OSDPError, match=r"'inner\.child\.weight' \(unit 'inner\.child'\) was read in the forward of "
                                        r"'inner' \(_ReadsChild\), outside the forward of its own module 'inner\.child'"
                                        r".*leaf_modules=\(_ReadsChild,\)"):
        model(torch.randn(2, 4))
    leaf = osdp.OSDP(_reads_child_net(calls_child), default_mode=mode, leaf_modules=(_ReadsChild,))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    losses = []
    for wrapped in (leaf, _reads_child_net(calls_child)):
        optim = torch.optim.AdamW(wrapped.parameters(), lr=0.05)
        for _ in range(3):
            nn.functional.cross_entropy(wrapped(x), y).backward()
            optim.step()
            optim.zero_grad()
        losses.append(nn.functional.cross_entropy(wrapped(x), y).item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_a_weight_read_outside_its_unit_is_refused_compiled_too():
    """On the compiled path a read through the child module found this rank's piece of
    the weight and failed on its shape deep inside dynamo (stock DeBERTa-v2's encoder
    reads its relative embeddings' weight: "expected input with shape [32], but got input
    of size [256, 1]"); it is refused naming the weight, and the leaf trains."""
    compile_arg = {"backend": "aot_eager"}
    torch._dynamo.reset()
    model = osdp.OSDP(_reads_child_net(True), default_mode="zdp", compile=compile_arg)
    with pytest.raises(OSDPError, match=r"read 'inner\.child\.weight' \(unit 'inner\.child'\) outside the forward "
                                        r"of its module 'inner\.child'.*leaf_modules="):
        model(torch.randn(2, 4))
    leaf = osdp.OSDP(_reads_child_net(True), default_mode="zdp", compile=compile_arg, leaf_modules=(_ReadsChild,))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    assert _train(leaf, x, y) == pytest.approx(_train(_reads_child_net(True), x, y), rel=1e-6)


def test_the_read_check_runs_on_the_first_forward_that_completes():
    """A first forward that fails (a wrong input, inside the child's forward) leaves the
    check for the next one, which does not take the child for running still; after one
    completes, no forward runs under it."""
    model = osdp.OSDP(_reads_child_net(True), default_mode="zdp")
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        model(torch.randn(2, 5))
    with pytest.raises(OSDPError, match="was read in the forward of 'inner'"):
        model(torch.randn(2, 4))
    fine = osdp.OSDP(_reads_child_net(False), default_mode="zdp", leaf_modules=(_ReadsChild,))
    fine(torch.randn(2, 4))
    assert fine._foreign_reads is None


def test_auto_mode_plans_a_leaf_that_owns_parameters_itself():
    """A leaf owning parameters beside its submodules' (``scale`` beside ``child``, as
    Mamba's mixer owns ``A_log`` and ``D``): auto mode's plan names it as one unit and
    the runtime takes it as a leaf (it took a plan unit owning parameters for an ordinary
    one: "the plan leaves out ... 'inner.child'"), training as the plain model."""
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    model = osdp.OSDP(_reads_child_net(True), memory_limit="1GiB", example_inputs=(x[:2],),
                      leaf_modules=(_ReadsChild,), auto_kwargs={"use_plan_cache": False})
    assert model.unit_names() == ["inner", "head"]
    plain = _reads_child_net(True)
    losses = []
    for wrapped in (model, plain):
        optim = torch.optim.AdamW(wrapped.parameters(), lr=0.05)
        for step in range(3):
            part = slice(2 * step, 2 * step + 2)
            nn.functional.cross_entropy(wrapped(x[part]), y[part]).backward()
            optim.step()
            optim.zero_grad()
        losses.append(nn.functional.cross_entropy(wrapped(x[:2]), y[:2]).item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


class OwnLogits(nn.Module):
    """Logits read off the embedding's weight by the model's own forward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mix = nn.Linear(4, 4)

    def forward(self, idx):
        return self.mix(self.emb(idx)) @ self.emb.weight.t()


def test_a_weight_read_by_the_model_itself_says_to_go_through_a_module():
    """The model's own forward reads its embedding's weight for the logits (no head
    module): the model cannot be a leaf, so the error says to tie a head to it, or to
    keep the unit rep (stock Perceiver's decoder reads its input embedding's weight,
    passed as an argument: a helper trained it so)."""
    torch.manual_seed(0)
    model = osdp.OSDP(OwnLogits(), default_mode="zdp")
    idx = torch.tensor([[1, 2, 3]])
    with pytest.raises(OSDPError, match=r"'emb\.weight' \(unit 'emb'\) was read in the forward of the model "
                                        r"\(OwnLogits\) itself.*an nn\.Linear whose weight is that embedding's"
                                        r".*modes=\{'emb': 'rep'\} \(in auto mode "
                                        r"settings=osdp\.planner\.PlannerSettings\(rep_units=\('emb',\)\)"):
        model(idx)
    torch.manual_seed(0)
    plain = OwnLogits()
    torch.manual_seed(0)
    kept = osdp.OSDP(OwnLogits(), default_mode="zdp", modes={"emb": "rep"})
    plain(idx).sum().backward()
    kept(idx).sum().backward()
    torch.testing.assert_close(kept(idx), plain(idx))
    torch.testing.assert_close(kept.module.emb.weight.grad, plain.emb.weight.grad)


def test_auto_mode_keeps_the_rep_unit_a_weight_read_outside_its_unit_needs():
    """In auto mode the error's escape is the planner's fixed rep set: its calibration
    measured FSDP (every unit zdp) first, which such a model cannot run, so auto mode
    failed whatever the settings; the reference plans keep those units rep now."""
    idx = torch.tensor([[1, 2, 3], [3, 2, 1]])
    torch.manual_seed(0)
    plain = OwnLogits()
    torch.manual_seed(0)
    model = osdp.OSDP(OwnLogits(), memory_limit="1GiB", example_inputs=(idx,),
                      settings=PlannerSettings(rep_units=("emb",)), auto_kwargs={"use_plan_cache": False})
    assert model.unit_modes() == {"emb": "rep", "mix": "zdp"}
    model(idx).sum().backward()
    plain(idx).sum().backward()
    torch.testing.assert_close(model.module.emb.weight.grad, plain.emb.weight.grad)
    with pytest.raises(OSDPError, match=r"auto_kwargs=\{'settings': \.\.\.\}: pass settings= to osdp\.OSDP itself"):
        osdp.OSDP(OwnLogits(), memory_limit="1GiB", example_inputs=(idx,), auto_kwargs={"settings": None})


class _ReadsChildSometimes(_ReadsChild):
    """Reads its child's weight only when asked: a data-dependent path the first
    forward did not take."""

    def forward(self, x, read: bool = False):
        y = self.child(x) * self.scale
        return y + x @ self.child.weight.t() if read else y


@pytest.mark.parametrize("mode", ["zdp", "dp"])
def test_a_weight_read_on_a_later_forward_is_refused(mode):
    """The first forward's check does not see a read on a path it did not take; the
    attribute itself refuses it on any later forward ([Note: weights read outside their
    unit]), where it found a freed buffer (zdp: ``setStorage ... out of bounds``) or,
    worse, the buffer dp keeps for backward: right values, a gradient that reaches no
    reduction, silently."""
    torch.manual_seed(0)
    model = osdp.OSDP(_ReadsChildSometimes(calls_child=True), default_mode=mode)
    x = torch.randn(2, 4)
    model(x).sum().backward()
    with pytest.raises(OSDPError, match=r"t\.default read 'child\.weight' \(unit 'child'\) outside the forward of its "
                                        r"module 'child'.*leaf_modules="):
        model(x, read=True)
    model(x).sum().backward()  # the failed forward left nothing behind


def test_a_sharded_weight_outside_its_forward_keeps_its_metadata_and_refuses_data():
    """Between steps a sharded unit's attribute tells its dtype, shape and device and
    refuses its values, naming where they are; a view of the freed buffer stood there
    (``weight.t()``: ``setStorage ... out of bounds``, ``weight.sum()``: a segmentation
    fault). Inside the forward, and through ``full_state_dict``, the values are there."""
    model = osdp.OSDP(_reads_child_net(False), default_mode="zdp", leaf_modules=(_ReadsChild,))
    model(torch.randn(2, 4)).sum().backward()
    weight = model.module.head.weight
    assert (weight.dtype, weight.shape, weight.device) == (torch.float32, (3, 4), torch.device("cpu"))
    assert "FreedWeight('head.weight', shape=(3, 4)" in repr(weight)
    for read in (lambda: weight.t(), lambda: torch.randn(2, 4) @ weight.T,
                 lambda: nn.init.normal_(weight), lambda: model.module.inner.child.weight.view(-1)):
        with pytest.raises(OSDPError, match=r"read '(head|inner\.child)\.weight'.*full_state_dict"):
            read()
    # a hook registered after wrapping runs after OSDP's: the forward is over
    model.module.head.register_forward_hook(lambda m, args, out: m.weight.detach().clone())
    with pytest.raises(OSDPError, match=r"detach\.default read 'head\.weight'"):
        model(torch.randn(2, 4))


def test_a_checkpointed_leaf_recomputes_with_its_weights():
    """A checkpointed block that is itself a unit (a leaf) recomputes without its module
    hooks: it computes with the weights of its forward, not the placeholders that stand
    between forwards."""
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    losses = []
    for mode in ("zdp", "dp"):
        model = osdp.OSDP(_reads_child_net(True), default_mode=mode, leaf_modules=(_ReadsChild,),
                          checkpoint_blocks=("inner",))
        losses.append(_train(model, x, y))
    losses.append(_train(_reads_child_net(True), x, y))
    assert losses[0] == pytest.approx(losses[2], rel=1e-6) and losses[1] == pytest.approx(losses[2], rel=1e-6)


def _train(model, x, y) -> float:
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    for _ in range(3):
        nn.functional.cross_entropy(model(x), y).backward()
        optim.step()
        optim.zero_grad()
    return nn.functional.cross_entropy(model(x), y).item()

