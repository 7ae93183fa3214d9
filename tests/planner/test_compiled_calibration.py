"""[Note: compiled plans] in osdp/auto.py: with ``compile=``, auto mode measures every plan
compiled (the factors are fitted to compiled steps, plans compared as they will run);
where a compiled step's peak is not measured (CPU), the eager step's peak goes with it.
Measurements are made up per plan here (a fake ``measure_plans``); the gloo run with real
compiled trials is tests/runtime/test_compiled.py::test_auto_mode_measures_its_plan_compiled."""
from types import SimpleNamespace

import pytest
import torch

import osdp.auto as auto
from osdp.measured_plans import MeasuredPlans
from osdp.models import GPTConfig
from osdp.planner.calibration import Measurement
from osdp.planner.cluster import load_cluster
from osdp.planner.cost_model import PlannerSettings
from osdp.planner.gpt_desc import describe_gpt
from osdp.planner.plan import format_plan
from osdp.planner.planner import make_plan
from osdp.planner.run import RunSettings
from osdp.runtime.compile_config import CompileConfig

CONFIG = GPTConfig(vocab_size=512, seq_len=64, num_layers=2, hidden=64, heads=4)


def _plans():
    desc = describe_gpt(CONFIG)
    device = load_cluster("titan-rtx-pcie3").with_(constant_bytes=0).for_run(
        RunSettings(world_size=2, memory_limit_bytes=64 * 2**20))
    zdp = make_plan(desc, device, PlannerSettings(policy="zdp", checkpointing="none"), backend="python",
                    baselines=False)
    dp = make_plan(desc, device, PlannerSettings(policy="dp", checkpointing="none"), backend="python",
                   baselines=False)
    assert zdp.plan_hash() != dp.plan_hash()
    return desc, device, zdp, dp


class _FakeMeasurePlans:
    """Compiled steps 60 ms and eager 100 ms (plan zdp) or 50/80 ms (plan dp); peaks
    measured only eager (CPU) or both (``cuda``); the calls it got."""

    def __init__(self, plans, cuda: bool):
        self.step = {plans[0].plan_hash(): (0.06, 0.10), plans[1].plan_hash(): (0.05, 0.08)}
        self.cuda, self.calls = cuda, []

    def __call__(self, model, plans, example_inputs, *, steps, pool, compile, **options):
        self.calls.append(([p.plan_hash() for p in plans], compile is not None))
        out = []
        for plan in plans:
            compiled_s, eager_s = self.step[plan.plan_hash()]
            s = compiled_s if compile is not None else eager_s
            peak = 0.0 if compile is not None and not self.cuda else (7e6 if compile is not None else 9e6)
            source = "not measured: compiled on CPU" if compile is not None and not self.cuda else "measured"
            out.append(Measurement(s, s / 3, s / 2, s / 6, peak, plan.batch_size, steps=3, peak_source=source))
            pool.current = SimpleNamespace(first_step_s=12.5 if compile is not None else 0.2)
        return out


def _measure(monkeypatch, plans, cuda: bool):
    fake = _FakeMeasurePlans(plans, cuda)
    monkeypatch.setattr(auto, "measure_plans", fake)
    monkeypatch.setattr(auto, "step_peak_readable", lambda device, compiled: cuda or not compiled)
    measure = auto.RuntimeMeasure(None, None, compile=CompileConfig(scope="blocks", backend="aot_eager"))
    return measure, fake


def test_on_cpu_every_plan_is_measured_compiled_with_the_eager_steps_peak(monkeypatch):
    _, _, zdp, dp = _plans()
    measure, fake = _measure(monkeypatch, [zdp, dp], cuda=False)
    m_zdp, m_dp = measure([zdp, dp])
    # compiled times, the eager step's peak (said so), marked compiled
    assert (m_zdp.step_s, m_dp.step_s) == (0.06, 0.05)
    assert m_zdp.peak_bytes == m_dp.peak_bytes == 9e6
    assert m_zdp.peak_source == "the eager step's: measured" and m_zdp.compiled and m_dp.compiled
    # each plan compiled on its own trial, then both eager
    assert fake.calls == [([zdp.plan_hash()], True), ([dp.plan_hash()], True), ([zdp.plan_hash(), dp.plan_hash()], False)]
    assert measure.eager_step_s == {zdp.plan_hash(): 0.10, dp.plan_hash(): 0.08}
    assert measure.first_compiled_step_s == {zdp.plan_hash(): 12.5, dp.plan_hash(): 12.5}
    # the record: both step times and the compile, no measurement again
    plan = auto.record_compiled(_with_measured(zdp, m_zdp), measure)
    assert plan.calibration.compiled == {"scope": "blocks", "step_s": 0.06, "eager_step_s": 0.10,
                                         "first_step_s": 12.5}
    assert len(fake.calls) == 3
    assert "measured on the runtime (compiled): step 60.00 ms" in format_plan(plan)


def test_on_cuda_the_compiled_steps_peak_is_its_own_and_the_eager_step_is_measured_once(monkeypatch):
    _, _, zdp, dp = _plans()
    measure, fake = _measure(monkeypatch, [zdp, dp], cuda=True)
    m_zdp, m_dp = measure([zdp, dp])
    assert (m_zdp.step_s, m_zdp.peak_bytes, m_zdp.peak_source, m_zdp.compiled) == (0.06, 7e6, "measured", True)
    assert fake.calls == [([zdp.plan_hash()], True), ([dp.plan_hash()], True)]  # no eager measurement
    plan = auto.record_compiled(_with_measured(dp, m_dp), measure)
    assert fake.calls[-1] == ([dp.plan_hash()], False)  # the report's eager step, measured now
    assert plan.calibration.compiled["eager_step_s"] == 0.08 and plan.calibration.compiled["step_s"] == 0.05


def test_an_eager_run_measures_eager_only(monkeypatch):
    _, _, zdp, dp = _plans()
    fake = _FakeMeasurePlans([zdp, dp], cuda=False)
    monkeypatch.setattr(auto, "measure_plans", fake)
    (m,) = auto.RuntimeMeasure(None, None)([zdp])
    assert fake.calls == [([zdp.plan_hash()], False)] and m.step_s == 0.10 and not m.compiled


def test_measured_plans_of_a_compiled_run_have_keys_of_their_own(tmp_path):
    desc, device, _, _ = _plans()
    cache = MeasuredPlans(tmp_path, enabled=True)
    args = (desc, device, PlannerSettings(), None, None, (torch.zeros(2, 8, dtype=torch.long),), None, None)
    eager = cache.key(*args)
    assert eager == cache.key(*args, None)  # eager keys as before
    blocks = cache.key(*args, CompileConfig(scope="blocks"))
    assert blocks != eager and blocks != cache.key(*args, CompileConfig(scope="model"))
    assert blocks == cache.key(*args, CompileConfig(scope="blocks"))
    assert cache.key(*args, CompileConfig()) == cache.key(*args, CompileConfig(scope="model"))  # the default


def test_a_measurement_says_whether_it_was_compiled():
    m = Measurement(0.1, 0.03, 0.05, 0.02, 1e6, 4, compiled=True)
    assert Measurement.from_dict(m.to_dict()).compiled
    assert not Measurement.from_dict({k: v for k, v in m.to_dict().items() if k != "compiled"}).compiled  # older plans


def _with_measured(plan, m):
    from dataclasses import replace

    return replace(plan, measured=m.to_dict())


@pytest.fixture(autouse=True)
def _no_process_group(monkeypatch):
    """RuntimeMeasure's budget and the rank agreement without a process group."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)


def test_a_compiled_run_plans_only_the_splits_the_compiled_path_runs():
    """The embedding's row split has no compiled forward: left whole; the matmul splits stay."""
    desc = describe_gpt(CONFIG)
    split = {op.name: op.split_op for op in desc.ops if op.splittable}
    assert split["wte"] == "embedding_rows" and "blocks.0.mlp.c_fc" in split
    runs = {op.name for op in auto.splits_the_compiled_path_runs(desc).ops if op.splittable}
    assert runs == {name for name, op in split.items() if op != "embedding_rows"}
    assert auto.splits_the_compiled_path_runs(desc).fingerprint() == desc.fingerprint()
