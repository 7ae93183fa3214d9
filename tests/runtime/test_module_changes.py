"""What users do to the modules of a wrapped model (one process, a 1-rank gloo group):
hooks registered before wrapping, casts of a module inside it after."""
from __future__ import annotations

import pytest
import torch

import osdp
from osdp.errors import OSDPError

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def _gpt():
    from osdp.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=8, num_layers=1, hidden=32, heads=4))


def _hooked_steps(hook, wrap: bool):
    """3 AdamW steps of a GPT whose MLP input Linear has ``hook(module, seen)``
    registered before wrapping; the losses and what the hook saw."""
    model, seen = _gpt(), []
    hook(model.blocks[0].mlp.c_fc, seen)
    model = osdp.OSDP(model, default_mode="zdp") if wrap else model
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        loss = model(idx, idx)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, seen


HOOKS_BEFORE_WRAPPING = {
    "forward pre-hook": lambda m, seen: m.register_forward_pre_hook(
        lambda mod, a: seen.append(mod.weight.norm().item())),
    "forward hook": lambda m, seen: m.register_forward_hook(lambda mod, a, y: seen.append(mod.weight.norm().item())),
    "weight_norm": lambda m, seen: torch.nn.utils.weight_norm(m),  # the old API: a pre-hook computes .weight
}


@pytest.mark.parametrize("hook", list(HOOKS_BEFORE_WRAPPING))
def test_hooks_registered_before_wrapping_see_the_gathered_weights(hook):
    """A module's own hooks from before wrapping run inside OSDP's: its pre-forward
    gathers first (prepended, as FSDP2's), its post-forward frees after them. A pre-hook
    ran before the gather and met the freed weight (torch.nn.utils.weight_norm's,
    always), and the first forward's check refused a forward hook that read the weight
    still gathered, blaming the parent (found by a helper)."""
    plain = _hooked_steps(HOOKS_BEFORE_WRAPPING[hook], wrap=False)
    wrapped = _hooked_steps(HOOKS_BEFORE_WRAPPING[hook], wrap=True)
    assert wrapped[0] == pytest.approx(plain[0], rel=1e-6)
    assert wrapped[1] == pytest.approx(plain[1], rel=1e-6)


@pytest.mark.parametrize("cast", ["unwrapped.half", "block.double", "unwrapped.to(bfloat16)"])
def test_a_module_cast_after_wrapping_is_refused_at_the_next_forward(cast):
    """The wrapper refuses .to() and casts; a module inside it (model.unwrapped, a
    block) went through nn.Module._apply, which swapped its parameters' data: the forward
    computed with the shards as before, silently under no_grad, and backward failed
    with torch's "assign a gradient with dtype 'float' to a tensor with grad_dtype
    'BFloat16'" (found by a helper)."""
    model = osdp.OSDP(_gpt(), default_mode="zdp")
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(idx, idx).backward()
    {"unwrapped.half": lambda: model.unwrapped.half(),
     "block.double": lambda: dict(model.named_modules())["blocks.0.mlp"].double(),
     "unwrapped.to(bfloat16)": lambda: model.unwrapped.to(torch.bfloat16)}[cast]()
    refused = r"parameter '.*' \(unit '.*'\) is no longer this rank's piece.*before wrapping"
    with pytest.raises(OSDPError, match=refused):
        with torch.no_grad():
            model(idx, idx)


def test_parameter_data_assigned_after_wrapping_is_refused_with_the_in_place_update():
    """``p.data = p.data - lr * p.grad`` (a hand-written SGD) swaps the data as a cast
    does; the refusal blamed a cast or move that never happened (found by a helper)."""
    model = osdp.OSDP(_gpt(), default_mode="zdp")
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(idx, idx).backward()
    for p in model.parameters():
        p.data = p.data - 0.1 * p.grad
    with pytest.raises(OSDPError, match=r"no longer this rank's piece of its unit: its data was replaced \(p.data = "
                                        r"\.\.\..*Update parameters in place.*p.data.add_"):
        model(idx, idx)
