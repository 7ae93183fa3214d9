"""``osdp.profiler.measure_plans``: the peak it reports is the steady step's, as the
independent reference tracker (``osdp.memtrack.LiveBytesTracker``) reads it."""
import copy

import pytest
import torch

import osdp
from osdp.memtrack import LiveBytesTracker
from osdp.models import GPT, GPTConfig, example_batch
from osdp.planner.cluster import DEFAULT_CLUSTER, load_cluster
from osdp.planner.cost_model import PlannerSettings
from osdp.planner.description import describe
from osdp.planner.run import RunSettings
from osdp.planner.uniform_plan import uniform_plan
from osdp.profiler import measure_plans

pytestmark = pytest.mark.usefixtures("one_rank_group")

CONFIG = GPTConfig(vocab_size=256, seq_len=32, num_layers=2, hidden=64, heads=4)


def _reference_peak(module, plan, inputs) -> int:
    """A steady step (the second) of another wrapped copy, under the slow tracker."""
    model = osdp.OSDP(copy.deepcopy(module), plan=plan, memory_check=False)
    optim = torch.optim.AdamW(model.parameters(), lr=0.0)
    for step in range(2):
        resident = list(model.parameters()) + list(model.buffers())
        resident += [t for s in optim.state.values() for t in s.values() if torch.is_tensor(t)]
        with LiveBytesTracker(resident) as tracker:
            model(*inputs).backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
    return tracker.peak_bytes


@pytest.mark.parametrize("warmup", [2, 1])
@pytest.mark.parametrize("zdp_slices", [0, 1])
def test_the_measured_peak_is_the_steady_steps_as_the_reference_reads_it(warmup, zdp_slices):
    torch.manual_seed(0)
    module = GPT(CONFIG)
    inputs = example_batch(CONFIG, 4)
    device = load_cluster(DEFAULT_CLUSTER).for_run(RunSettings(world_size=1, memory_limit_bytes=64 << 20))
    plan = uniform_plan(describe(module, inputs), device, PlannerSettings(), 4, slices=1, zdp_slices=zdp_slices)
    # warmup 2: read in the second warm-up step; 1: in a step after the timed ones
    measured = measure_plans(module, [plan], inputs, steps=1, warmup=warmup, group_times=False)[0]
    assert "step tracker" in measured.peak_source
    reference = _reference_peak(module, plan, inputs)
    assert abs(measured.peak_bytes - reference) <= 0.002 * reference
