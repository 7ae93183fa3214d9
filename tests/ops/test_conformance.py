"""One conformance suite over every registered split op (``osdp.ops``): forward and
backward against fp64 (error at most twice PyTorch's own fp32 error, both against
fp64), the split op's registry declaration, the peak of gathered weights (one slice at
a time without prefetch), and training parity on 2 gloo ranks against single-process
training. Adding a split op = its file + its example in ``op_cases.py``."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from osdp.ops import get_split_op, registered_split_ops

from . import op_cases as oc
from runtime.dist_harness import spawn

pytestmark = pytest.mark.usefixtures("one_rank_group")
OPS = oc.op_names()


def test_every_registered_op_has_an_example():
    assert set(OPS) == set(oc.EXAMPLES), "add an example module for each split op to tests/ops/op_cases.py"


@pytest.mark.parametrize("op_name", OPS)
def test_declaration(op_name):
    op = registered_split_ops()[op_name]
    module, _ = oc.example(op_name)
    assert op.op_name == op_name and type(module) is op.module_type
    assert op.axis in ("in_features", "out_features", "rows")
    length = op.axis_length(module)
    assert get_split_op(module, "m", op_name=op_name) is op
    # the slices are boxes along the declared axis that merge back to the module exactly
    g = 3
    slices = op.slice_tensors(module, g)
    merged = op.merge(slices)
    for name, p in module.named_parameters():
        assert torch.equal(merged[name], p.detach()), name
    cut = [s["weight"] for s in slices]
    assert sum(t.numel() for t in cut) == module.weight.numel()
    assert len({t.shape for t in cut}) > 1 or length % g == 0, "uneven sizes when the axis does not divide"


def _fp64_reference(module, x):
    ref = nn.Sequential(module).double()
    x64 = x.double().requires_grad_(True) if x.is_floating_point() else x
    y = ref(x64)
    return y, x64, ref


@pytest.mark.parametrize("op_name", OPS)
@pytest.mark.parametrize("g", [2, 3])
def test_forward_backward_against_fp64(op_name, g):
    module, inputs = oc.example(op_name)
    plain, _ = oc.example(op_name)
    x = inputs(torch.Generator().manual_seed(1))
    wrapped = oc.wrap(module, op_name, g)
    floating = x.is_floating_point()
    xs, xp = (x.clone().requires_grad_(True), x.clone().requires_grad_(True)) if floating else (x, x)
    weights = torch.randn(*x.shape[:2], *plain(xp[:1]).shape[2:], generator=torch.Generator().manual_seed(2))
    y, y_plain = wrapped(xs), nn.Sequential(plain)(xp)
    (y * weights).sum().backward()
    (y_plain * weights).sum().backward()
    y64, x64, ref = _fp64_reference(oc.example(op_name)[0], x)
    (y64 * weights.double()).sum().backward()

    def check(ours, torch32, exact, what):
        ours_err = (ours.double() - exact).abs().max().item()
        torch_err = (torch32.double() - exact).abs().max().item()
        assert ours_err <= 2 * torch_err + 1e-12, f"{op_name} g={g} {what}: {ours_err:.3g} vs torch {torch_err:.3g}"

    check(y, y_plain, y64, "forward")
    if floating:
        check(xs.grad, xp.grad, x64.grad, "dX")
    state = wrapped.full_state_dict()  # gathered gradients: through the parameters' pieces
    grads = {}
    for unit in wrapped._built.units:
        flat = unit.sharded_grad()
        for slot, (start, n) in zip(unit.slots, unit.local_ranges):  # one rank: n is the whole slot
            grads.setdefault(slot.attr, []).append(flat.narrow(0, start, n).reshape(slot.shape))
    merged = get_split_op(plain, "0", op_name).merge(
        [{k: v[i] for k, v in grads.items() if i < len(v)} for i in range(g)]
    )
    for name, p in ref.named_parameters():
        attr = name.split(".", 1)[1]
        check(merged[attr], dict(plain.named_parameters())[attr].grad, p.grad, f"d{attr}")
    assert set(state) == {f"0.{n}" for n, _ in plain.named_parameters()}


@pytest.mark.parametrize("op_name", OPS)
def test_a_float64_model_splits_in_float64(op_name):
    """A split sums its slices in fp32 or the input's dtype where that is wider: a
    float64 model split in 3 differed from the unsplit one by 1.4e-8 (found by a helper),
    where float64 rounding is 1e-16."""
    module, inputs = oc.example(op_name)
    plain = nn.Sequential(oc.example(op_name)[0]).double()
    x = inputs(torch.Generator().manual_seed(1))
    x = x.double() if x.is_floating_point() else x
    wrapped = oc.wrap(module.double(), op_name, 3)
    xs, xp = (x.clone().requires_grad_(True), x.clone().requires_grad_(True)) if x.is_floating_point() else (x, x)
    y, y_plain = wrapped(xs), plain(xp)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, y_plain, rtol=1e-13, atol=1e-13)
    y.pow(2).sum().backward()
    y_plain.pow(2).sum().backward()
    if x.is_floating_point():
        torch.testing.assert_close(xs.grad, xp.grad, rtol=1e-13, atol=1e-13)
    grads = {name: p.grad for name, p in plain.named_parameters()}
    for name, value in wrapped.full_state_dict().items():  # the parameters only: the step below moves them
        assert value.dtype == torch.float64, name
    opt = torch.optim.SGD(wrapped.parameters(), lr=1.0)
    before = {k: v.clone() for k, v in wrapped.full_state_dict().items()}
    opt.step()
    for name, value in wrapped.full_state_dict().items():
        torch.testing.assert_close(before[name] - value, grads[name], rtol=1e-12, atol=1e-13, msg=name)


@pytest.mark.parametrize("op_name", OPS)
def test_one_slice_gathered_at_a_time(op_name):
    module, inputs = oc.example(op_name)
    wrapped = oc.wrap(module, op_name, 3, modes=("zdp",) * 3, prefetch_bytes=0)
    wrapped(inputs(torch.Generator().manual_seed(3))).sum().backward()
    stats = wrapped.memory_stats()
    biggest = max(u.gathered_bytes for u in wrapped._built.units)
    assert stats["peak_gathered_bytes"] == biggest, stats["unit_peak_gathered_bytes"]
    assert stats["current_gathered_bytes"] == 0


_PARITY: dict = {}


@pytest.mark.parametrize("op_name", OPS)
def test_parity_on_two_ranks(op_name):
    if op_name not in _PARITY:
        _PARITY[op_name] = spawn(oc.parity_run, 2, op_name)
    (losses, ref_losses, state, ref_state), _ = _PARITY[op_name]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
