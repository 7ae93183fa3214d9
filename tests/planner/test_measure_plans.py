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
from osdp.profiler import TrialPool, measure_plans
from osdp.profiler import runtime as runtime_profiler

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


def _plans():
    torch.manual_seed(0)
    module = GPT(CONFIG)
    inputs = example_batch(CONFIG, 4)
    desc = describe(module, inputs)
    device = load_cluster(DEFAULT_CLUSTER).for_run(RunSettings(world_size=1, memory_limit_bytes=64 << 20))
    fsdp = uniform_plan(desc, device, PlannerSettings(), 4, slices=1, zdp_slices=1)
    dp = uniform_plan(desc, device, PlannerSettings(), 4, slices=1, zdp_slices=0)
    return module, inputs, fsdp, dp


def test_a_pool_times_a_plan_again_on_its_warm_copy_and_closes_the_copies_no_call_wants(monkeypatch):
    module, inputs, fsdp, dp = _plans()
    made, steps = [], []
    real_init, real_step = runtime_profiler._Trial.__init__, runtime_profiler._Trial.step

    def counting_init(self, module, plan, *args):
        made.append(plan.plan_hash())
        real_init(self, module, plan, *args)

    def counting_step(self, measure_peak=False):
        steps.append((self.plan.plan_hash(), measure_peak))
        return real_step(self, measure_peak)

    monkeypatch.setattr(runtime_profiler._Trial, "__init__", counting_init)
    monkeypatch.setattr(runtime_profiler._Trial, "step", counting_step)
    pool = TrialPool()
    first = measure_plans(module, [fsdp], inputs, steps=2, group_times=False, pool=pool)[0]
    # warm-up: a first step, then the peak's (which runs one step inside); 2 timed steps
    warmed_up = [False, True, False]
    assert made == [fsdp.plan_hash()] and [s[1] for s in steps] == warmed_up + [False] * 2
    warm = pool._trials[fsdp.plan_hash()]
    steps.clear()
    again, other = measure_plans(module, [fsdp, dp], inputs, steps=3, group_times=False, pool=pool)
    # fsdp: no new copy, no warm-up, 3 timed steps of this call only; dp: a copy warmed up
    assert made == [fsdp.plan_hash(), dp.plan_hash()]
    assert [s for s in steps if s[0] == fsdp.plan_hash()] == [(fsdp.plan_hash(), False)] * 3
    assert [s[1] for s in steps if s[0] == dp.plan_hash()] == warmed_up + [False] * 3
    assert pool._trials[fsdp.plan_hash()] is warm and again.steps == 3
    assert again.peak_bytes == first.peak_bytes  # the steady step's peak, read once
    kept_dp = pool._trials[dp.plan_hash()]
    measure_plans(module, [fsdp], inputs, steps=1, group_times=False, pool=pool)
    assert kept_dp.model is None and dp.plan_hash() not in pool._trials  # closed: not in this call
    pool.close()
    assert warm.model is None and not pool._trials


def test_without_a_pool_no_copy_outlives_the_call(monkeypatch):
    module, inputs, fsdp, _ = _plans()
    trials = []
    real_init = runtime_profiler._Trial.__init__

    def keeping_init(self, *args):
        trials.append(self)
        real_init(self, *args)

    monkeypatch.setattr(runtime_profiler._Trial, "__init__", keeping_init)
    measure_plans(module, [fsdp, fsdp], inputs, steps=1, group_times=False)
    assert len(trials) == 2 and all(t.model is None for t in trials)
