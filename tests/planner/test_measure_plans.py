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
from osdp.profiler import plans as runtime_profiler

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


def _counting(monkeypatch):
    """Trials made (plan hashes), trials alive at once (max), steps taken."""
    made, alive, steps = [], [0, 0], []
    real_init, real_close, real_step = (runtime_profiler._Trial.__init__, runtime_profiler._Trial.close,
                                        runtime_profiler._Trial.step)

    def counting_init(self, module, plan, *args):
        made.append(plan.plan_hash())
        real_init(self, module, plan, *args)
        alive[0] += 1
        alive[1] = max(alive)

    def counting_close(self):
        alive[0] -= self.model is not None
        real_close(self)

    def counting_step(self, measure_peak=False):
        steps.append((self.plan.plan_hash(), measure_peak))
        return real_step(self, measure_peak)

    monkeypatch.setattr(runtime_profiler._Trial, "__init__", counting_init)
    monkeypatch.setattr(runtime_profiler._Trial, "close", counting_close)
    monkeypatch.setattr(runtime_profiler._Trial, "step", counting_step)
    return made, alive, steps


def test_a_pool_times_a_plan_again_on_its_warm_trial_and_keeps_one_trial_alive(monkeypatch):
    module, inputs, fsdp, dp = _plans()
    made, alive, steps = _counting(monkeypatch)
    pool = TrialPool()
    first = measure_plans(module, [fsdp], inputs, steps=2, group_times=False, pool=pool)[0]
    # warm-up: a first step, then the peak's (which runs one step inside); 2 timed steps
    warmed_up = [False, True, False]
    assert made == [fsdp.plan_hash()] and [s[1] for s in steps] == warmed_up + [False] * 2
    warm = pool.current
    steps.clear()
    again, other = measure_plans(module, [fsdp, dp], inputs, steps=3, group_times=False, pool=pool)
    # fsdp: its warm trial, no warm-up, 3 timed steps; dp: a trial of its own, warmed up
    assert made == [fsdp.plan_hash(), dp.plan_hash()]
    assert [s for s in steps if s[0] == fsdp.plan_hash()] == [(fsdp.plan_hash(), False)] * 3
    assert [s[1] for s in steps if s[0] == dp.plan_hash()] == warmed_up + [False] * 3
    assert again.steps == 3 and again.peak_bytes == first.peak_bytes  # the steady step's peak, read once
    assert warm.model is None and pool.current.plan.plan_hash() == dp.plan_hash()  # one trial at a time
    pool.close()
    assert pool.current is None and alive == [0, 1]


def test_without_a_pool_no_trial_outlives_the_call(monkeypatch):
    module, inputs, fsdp, dp = _plans()
    made, alive, _ = _counting(monkeypatch)
    measure_plans(module, [fsdp, dp, fsdp], inputs, steps=1, group_times=False)
    assert made == [fsdp.plan_hash(), dp.plan_hash(), fsdp.plan_hash()] and alive == [0, 1]


def test_measuring_moves_no_weight_and_a_meta_model_is_measured_from_a_wrapped_ones_values():
    """The trials are filled from the model (real) or from a wrapped model's shards
    (meta: nothing else holds its values); lr-0 steps leave every weight as it was."""
    module, inputs, fsdp, dp = _plans()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with torch.device("meta"):
        skeleton = GPT(CONFIG)
    holder = osdp.OSDP(copy.deepcopy(module), default_mode="zdp")
    pool = TrialPool(holder=holder)
    measure_plans(skeleton, [dp, fsdp], inputs, steps=1, group_times=False, pool=pool)  # the second from the first
    trial = pool.current.model
    for key, value in trial.full_state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    with pytest.raises(osdp.OSDPError, match="on the meta device needs its values"):
        measure_plans(skeleton, [fsdp], inputs, steps=1, group_times=False)
    pool.close()
