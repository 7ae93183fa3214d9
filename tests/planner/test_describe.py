"""describe() measures a real forward; describe_gpt() derives the same from a config."""
import dataclasses

import pytest
import torch
import torch.nn as nn

import osdp.planner as planner
from osdp.errors import OSDPError
from osdp.models import GPT, GPTConfig, example_batch
from osdp.planner.description import ModelDesc, describe
from osdp.planner.gpt_desc import describe_gpt

CONFIGS = [
    GPTConfig(),
    GPTConfig(tie_embeddings=True),
    GPTConfig(block_hidden=(64, 128), heads=4),
    GPTConfig(seq_len=32, hidden=48, heads=3, num_layers=3, vocab_size=97),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"L{c.num_layers}h{c.hidden}w{c.block_hidden}t{c.tie_embeddings}")
def test_measured_description_matches_analytic(config):
    torch.manual_seed(0)
    model = GPT(config)
    measured = describe(model, example_batch(config, 4))
    analytic = describe_gpt(config)
    assert [op.name for op in measured.ops] == [op.name for op in analytic.ops]
    widths = dict(zip((f"blocks.{i}" for i in range(config.num_layers)), config.widths))
    for got, want in zip(measured.ops, analytic.ops):
        same = dataclasses.replace(want, act_grad_bytes_per_sample=got.act_grad_bytes_per_sample)
        assert got == same, f"{got.name}: measured {got} vs analytic {want}"
        # backward transients: the analytic value bounds the measured one from above,
        # exactly for every unit but attention (see gpt_desc's docstring)
        slack = config.seq_len * widths.get(want.block, config.hidden) * 4
        assert got.act_grad_bytes_per_sample <= want.act_grad_bytes_per_sample + 1e-6, got.name
        if "c_attn" in got.name or (config.tie_embeddings and got.name in ("wte", "ln_f")):
            assert want.act_grad_bytes_per_sample - got.act_grad_bytes_per_sample <= slack * 2.5, got.name
        else:
            assert want.act_grad_bytes_per_sample == pytest.approx(got.act_grad_bytes_per_sample, abs=1e-6), got.name
    assert measured.blocks == analytic.blocks
    assert measured.fingerprint() == analytic.fingerprint()
    assert measured.param_count == sum(p.numel() for p in model.parameters())


def test_units_follow_execution_order_not_registration_order():
    class Reversed(nn.Module):
        def __init__(self):
            super().__init__()
            self.second = nn.Linear(8, 4)
            self.first = nn.Linear(4, 8)

        def forward(self, x):
            return self.second(torch.relu(self.first(x)))

    desc = describe(Reversed(), (torch.randn(3, 4),))
    assert [op.name for op in desc.ops] == ["first", "second"]
    # relu's saved output belongs to the unit that ran before it; `second` saves the
    # same tensor as its input, which is one allocation and is not counted again
    assert desc.ops[0].act_bytes_per_sample == pytest.approx(4 * 4 + 8 * 4)
    assert desc.ops[1].act_bytes_per_sample == 0


def test_saved_tensor_shared_by_two_ops_counts_once():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16, bias=False)
            self.b = nn.Linear(16, 16, bias=False)

        def forward(self, x):
            return self.a(x) + self.b(x)  # both save x

    desc = describe(Shared(), (torch.randn(2, 16),))
    assert sum(op.act_bytes_per_sample for op in desc.ops) == pytest.approx(16 * 4)


class _DeadBranch(nn.Module):
    """A router-like forward: a branch computed with grad whose values no later op reads
    (only its indices leave), so its graph node, and what the node saved, are freed
    before the forward ends."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(64, 64)
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        scores = self.router(x)
        order = torch.exp(scores * 2).topk(4, dim=-1).indices  # exp saves its output: dead with the branch
        return self.proj(x * scores.sigmoid()).gather(-1, order).sum()


@pytest.mark.parametrize("fake", [False, True])
def test_saved_tensors_freed_in_the_forward_are_not_counted(fake):
    """[Note: saved and still alive]: against the bytes live at the end of the forward,
    over the parameters and the output, measured by the live-bytes tracker."""
    from osdp.memtrack import LiveBytesTracker, resident_tensors

    torch.manual_seed(0)
    model, x = _DeadBranch(), torch.randn(32, 64)
    desc = describe(model, (x,), measure_backward=False, fake=fake)
    with LiveBytesTracker(resident_tensors(model)) as tracker:
        out = model(x)
        tracker.track(())  # sampled anew: the sum's input died after the last operator
        held = tracker.current_bytes - sum(p.numel() * 4 for p in model.parameters()) - out.numel() * 4
    described = sum(op.act_bytes_per_sample for op in desc.ops) * 32 + desc.act_constant_bytes
    assert described == held  # counted when saved, the dead exp output (32 x 64 fp32) made it 8 KiB more
    assert all(describe(model, (x,), measure_backward=False, fake=fake) == desc for _ in range(3))


def test_model_without_parameters_is_rejected():
    with pytest.raises(OSDPError, match="no parameters"):
        describe(nn.ReLU(), (torch.randn(2, 3),))


def test_description_round_trips_through_dict():
    desc = describe_gpt(GPTConfig(block_hidden=(64, 128)))
    assert ModelDesc.from_dict(desc.to_dict()) == desc


@pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py
def test_a_unit_that_never_runs_is_priced_last():
    """A module holding parameters the forward never calls (an unused pooler): its shards
    and optimizer states exist all the same, so it is an op (last, no work), and a plan
    of the model names every unit the runtime makes ([Note: units that never ran])."""
    import osdp

    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(8, 8)
            self.pooler = nn.Linear(8, 8)  # never called
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(torch.relu(self.used(x))).sum()

    torch.manual_seed(0)
    model = WithUnused()
    desc = describe(model, (torch.randn(4, 8),))
    assert [op.name for op in desc.ops] == ["used", "head", "pooler"]
    pooler = desc.ops[2]
    assert (pooler.param_count, pooler.flops_per_sample, pooler.act_bytes_per_sample) == (72, 0.0, 0.0)
    plan = planner.make_plan(desc, planner.load_cluster("titan-rtx-pcie3").for_run(
        planner.RunSettings(world_size=1, memory_limit_bytes=2**30)))
    osdp.OSDP(model, plan.runtime_config(), memory_check=False)


@pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py
def test_a_unit_that_never_runs_inside_a_block_stays_in_its_block():
    """An unused module inside a layer comes after the layer's last unit, so the layer
    is one contiguous block (last of all, it split the block: "does not run as one
    contiguous piece; it cannot be checkpointed"), and auto mode plans and trains it."""
    import osdp

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.side = nn.Linear(8, 8)  # never called

        def forward(self, x):
            return torch.relu(self.fc(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer()])
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x).sum()

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    desc = describe(Net(), (x,))
    assert [op.name for op in desc.ops] == ["layers.0.fc", "layers.0.side", "layers.1.fc", "layers.1.side", "head"]
    assert [(b.name, b.first_op, b.num_ops) for b in desc.blocks] == [("layers.0", 0, 2), ("layers.1", 2, 2)]
    assert (desc.ops[1].param_count, desc.ops[1].flops_per_sample) == (72, 0.0)
    torch.manual_seed(0)
    model = osdp.OSDP(Net(), memory_limit="1GiB", example_inputs=(x,), auto_kwargs={"use_plan_cache": False})
    model(x).backward()
    assert set(model.unit_names()) >= {"layers.0.side", "layers.1.side"}
