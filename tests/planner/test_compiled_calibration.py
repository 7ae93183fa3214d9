"""[Note: compiled plans] in osdp/compiled_choice.py: with ``compile=``, auto mode
calibrates and chooses on eager steps, then measures its finalists compiled and keeps
the fastest compiled; where a compiled step's peak is not measured (CPU), the eager
step's peak goes with it. Measurements are made up per plan here (a fake
``measure_plans``); the gloo run with real compiled trials is
tests/runtime/test_compiled.py::test_auto_mode_measures_its_plan_compiled."""
from dataclasses import replace
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
    """Compiled steps 60 ms and eager 100 ms (plan zdp) or 50/80 ms (plan dp); a
    compiled trial's peak measured (``compiled_peak``: the CUDA allocator's, or on CPU
    the allocator's reports) or not (another profiler recording); the calls it got."""

    def __init__(self, plans, compiled_peak: bool):
        self.step = {plans[0].plan_hash(): (0.06, 0.10), plans[1].plan_hash(): (0.05, 0.08)}
        self.peaked, self.calls, self.steps = compiled_peak, [], []

    def __call__(self, model, plans, example_inputs, *, steps, pool, compile, **options):
        self.calls.append(([p.plan_hash() for p in plans], compile is not None))
        self.steps.append(steps)
        out = []
        for plan in plans:
            compiled_s, eager_s = self.step[plan.plan_hash()]
            s = compiled_s if compile is not None else eager_s
            peak = 0.0 if compile is not None and not self.peaked else (7e6 if compile is not None else 9e6)
            source = "not measured: a profiler was recording" if compile is not None and not self.peaked else "measured"
            out.append(Measurement(s, s / 3, s / 2, s / 6, peak, plan.batch_size, steps=3, peak_source=source))
            pool.current = SimpleNamespace(first_step_s=12.5 if compile is not None else 0.2)
        return out


def _measure(monkeypatch, plans, compiled_peak: bool, cuda: bool = False):
    fake = _FakeMeasurePlans(plans, compiled_peak)
    monkeypatch.setattr(auto, "measure_plans", fake)
    monkeypatch.setattr(auto, "step_peak_readable", lambda device, compiled: cuda or not compiled)
    measure = auto.RuntimeMeasure(None, None, compile=CompileConfig(scope="blocks", backend="aot_eager"))
    measure.pool.current = SimpleNamespace(first_step_s=0.0)
    return measure, fake


def test_a_compiled_run_measures_eager_and_its_finalists_compiled(monkeypatch):
    _, _, zdp, dp = _plans()
    measure, fake = _measure(monkeypatch, [zdp, dp], compiled_peak=False)
    (m,) = measure([zdp])  # calibration and the measured choice: eager
    assert fake.calls == [([zdp.plan_hash()], False)] and m.step_s == 0.10 and not m.compiled
    eager_dp = _eager(dp)
    m_zdp, m_dp = measure.compiled([(zdp, m), (dp, eager_dp)])
    # each on its own trial, compiled times; on CPU the eager measurement's peak, said
    # so (no compiled allocator bytes to keep beside it: a profiler was recording)
    assert fake.calls[1:] == [([zdp.plan_hash()], True), ([dp.plan_hash()], True)]
    assert (m_zdp.step_s, m_dp.step_s) == (0.06, 0.05) and m_zdp.compiled and m_dp.compiled
    assert (m_zdp.peak_bytes, m_dp.peak_bytes) == (9e6, 8e6)
    assert m_dp.peak_source == "the eager step's: eager, made up" and measure.compiled_cpu_peaks == {}
    assert measure.first_compiled_step_s == {zdp.plan_hash(): 12.5, dp.plan_hash(): 12.5}


def test_on_cuda_a_compiled_trial_is_held_to_its_own_peak(monkeypatch):
    _, _, zdp, dp = _plans()
    measure, fake = _measure(monkeypatch, [zdp, dp], compiled_peak=True, cuda=True)
    (m,) = measure.compiled([(dp, _eager(dp))])
    assert (m.step_s, m.peak_bytes, m.peak_source, m.compiled) == (0.05, 7e6, "measured", True)
    assert fake.calls == [([dp.plan_hash()], True)]  # no eager measurement again
    assert measure.compiled_cpu_peaks == {}


def test_on_cpu_a_compiled_trial_is_held_to_the_eager_live_tensors_its_allocator_bytes_kept(monkeypatch):
    """[Note: compiled memory]: on CPU the limit is in live tensors, which compiled code
    allocates beneath; the compiled step's allocator bytes are another measure."""
    _, _, zdp, dp = _plans()
    measure, fake = _measure(monkeypatch, [zdp, dp], compiled_peak=True, cuda=False)
    (m,) = measure.compiled([(dp, _eager(dp))])
    assert (m.step_s, m.peak_bytes, m.compiled) == (0.05, 8e6, True)
    assert m.peak_source == "the eager step's: eager, made up"
    assert measure.compiled_cpu_peaks == {dp.plan_hash(): 7e6}


def test_the_compiled_trials_time_all_their_steps_whatever_the_budget(monkeypatch):
    _, _, zdp, _ = _plans()
    measure, fake = _measure(monkeypatch, [zdp, zdp], compiled_peak=False)
    measure.budget.steps = lambda plans, steps, warmup: 1  # a spent budget: one timed step
    measure([zdp])
    measure.compiled([(zdp, _eager(zdp))])
    assert fake.steps == [1, measure.steps]


def test_an_eager_run_measures_eager_only(monkeypatch):
    _, _, zdp, dp = _plans()
    fake = _FakeMeasurePlans([zdp, dp], compiled_peak=False)
    monkeypatch.setattr(auto, "measure_plans", fake)
    (m,) = auto.RuntimeMeasure(None, None)([zdp])
    assert fake.calls == [([zdp.plan_hash()], False)] and m.step_s == 0.10 and not m.compiled


def _eager(plan, step_s=0.08, peak=8e6):
    return Measurement(step_s, step_s / 3, step_s / 2, step_s / 6, peak, plan.batch_size, steps=3,
                       peak_source="eager, made up")


def test_the_finalists_are_the_eager_pick_and_the_fastest_other_schedule_near_it():
    from osdp.compiled_choice import finalists

    _, _, zdp, dp = _plans()
    pick = (dp, _eager(dp, 0.080))
    larger = replace(dp, batch_size=dp.batch_size + 1)  # the pick's schedule: never a finalist
    near, far = (zdp, _eager(zdp, 0.090)), (zdp, _eager(zdp, 0.200))
    assert finalists(*pick, [pick, (larger, _eager(larger, 0.070)), near]) == [pick, near]
    assert finalists(*pick, [pick, far]) == [pick]  # more than FINALIST_MARGIN behind
    over = (zdp, _eager(zdp, 0.090, peak=2 * zdp.memory_limit_bytes))
    assert finalists(*pick, [over]) == [pick]  # over its limit
    assert finalists(*pick, [near], most=1) == [pick]


def test_the_compiled_choice_keeps_the_fastest_finalist_compiled(monkeypatch):
    """zdp is the eager pick (80 ms a step against dp's 85 ms, one batch) but dp runs
    faster compiled (50 ms against 90): dp is kept, with its eager measurement and its
    own predictions; the record lists both finalists."""
    from osdp.compiled_choice import compiled_choice
    from osdp.planner.calibration import format_report

    desc, device, zdp, dp = _plans()
    dp = replace(dp, batch_size=zdp.batch_size)
    measure, fake = _measure(monkeypatch, [zdp, dp], compiled_peak=False)
    fake.step = {zdp.plan_hash(): (0.09, 0.08), dp.plan_hash(): (0.05, 0.085)}
    e_zdp, e_dp = _eager(zdp, 0.080), _eager(dp, 0.085)
    picked = replace(zdp, measured=e_zdp.to_dict())
    chosen = compiled_choice(desc, device, picked, [(picked, e_zdp), (dp, e_dp)], measure, **_CHOICE)
    assert chosen.plan_hash() == dp.plan_hash()
    assert Measurement.from_dict(chosen.measured) == e_dp  # its eager measurement
    record = chosen.calibration.compiled
    assert record["kept"] == dp.plan_hash() and record["step_s"] == 0.05 and record["eager_step_s"] == 0.085
    assert record["first_step_s"] == 12.5 and [f["plan"] for f in record["finalists"]] == [zdp.plan_hash(),
                                                                                           dp.plan_hash()]
    assert chosen.calibration.predicted_step_s is not None
    report = format_report(chosen)
    assert "compiled choice: kept a plan other than the eager pick" in report and "the rows below are eager" in report
    # the factors refitted to the two compiled steps, and the kept plan's step they predict
    assert record["compute_scale"] > 0 and record["backward_compute_scale"] > 0 and record["predicted_step_s"] > 0
    assert "fitted to the compiled steps: compute scale" in report
    # compiled slower than the pick: the pick stays, its record says so
    fake.step = {zdp.plan_hash(): (0.05, 0.08), dp.plan_hash(): (0.09, 0.085)}
    kept = compiled_choice(desc, device, picked, [(picked, e_zdp), (dp, e_dp)], measure, **_CHOICE)
    assert kept.plan_hash() == zdp.plan_hash() and kept.calibration.compiled["kept"] == zdp.plan_hash()
    assert "compiled choice: kept the eager pick" in format_report(kept)


def test_measured_plans_of_a_compiled_run_have_keys_of_their_own(tmp_path, monkeypatch):
    desc, device, _, _ = _plans()
    cache = MeasuredPlans(tmp_path, enabled=True)
    args = (desc, device, PlannerSettings(), None, None, (torch.zeros(2, 8, dtype=torch.long),), None, None)
    eager = cache.key(*args)
    assert eager == cache.key(*args, None)  # eager keys as before
    blocks = cache.key(*args, CompileConfig(scope="blocks"))
    assert blocks != eager and blocks != cache.key(*args, CompileConfig(scope="model"))
    assert blocks == cache.key(*args, CompileConfig(scope="blocks"))
    assert cache.key(*args, CompileConfig()) == cache.key(*args, CompileConfig(scope="model"))  # the default
    # a change to the code of OSDP's inductor passes (its hash) measures compiled plans again
    from osdp.runtime import compiled_coalesce, compiled_prefetch

    for module in (compiled_coalesce, compiled_prefetch):
        with monkeypatch.context() as patch:
            patch.setattr(module, "RULES_HASH", "0" * 16)
            assert cache.key(*args, CompileConfig(scope="blocks")) != blocks
    assert cache.key(*args, CompileConfig(scope="blocks")) == blocks


def test_a_measurement_says_whether_it_was_compiled():
    m = Measurement(0.1, 0.03, 0.05, 0.02, 1e6, 4, compiled=True)
    assert Measurement.from_dict(m.to_dict()).compiled
    assert not Measurement.from_dict({k: v for k, v in m.to_dict().items() if k != "compiled"}).compiled  # older plans


def _with_measured(plan, m):
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


_CHOICE = dict(settings=PlannerSettings(checkpointing="none"), backend="python")


class _CompiledSteps:
    """A measure whose ``compiled`` hands out the next made-up step time per plan, in
    the order they are asked for (``other``: for plans not named), with a compiled peak
    of ``peak(plan)`` (None: the eager one); eager steps 80 ms at 8 MB; the order of the
    calls it got."""

    def __init__(self, steps: dict, other=(0.05,), peak=lambda plan: None):
        self.steps, self.other = {k: list(v) for k, v in steps.items()}, list(other)
        self.compile, self.peak = CompileConfig(), peak
        self.first_compiled_step_s, self.calls = {}, []

    def __call__(self, plans):
        self.calls.append(("eager", [p.plan_hash() for p in plans]))
        return [_eager(p) for p in plans]

    def compiled(self, pairs):
        self.calls.append([p.plan_hash() for p, _ in pairs])
        out = []
        for plan, eager in pairs:
            self.first_compiled_step_s.setdefault(plan.plan_hash(), 12.5)
            step_s = self.steps.get(plan.plan_hash(), self.other).pop(0)
            peak = self.peak(plan)
            out.append(replace(eager, step_s=step_s, compiled=True,
                               peak_bytes=eager.peak_bytes if peak is None else peak))
        return out


def test_two_finalists_measured_close_compiled_are_measured_again_in_the_other_order():
    """dp measured 2% faster compiled in the first round (within REPEAT_MARGIN), zdp 20%
    faster in the second: on their mean steps zdp is kept; the repeat ran dp first."""
    from osdp.compiled_choice import compiled_choice

    desc, device, zdp, dp = _plans()
    dp = replace(dp, batch_size=zdp.batch_size)
    e_zdp, e_dp = _eager(zdp, 0.080), _eager(dp, 0.085)
    picked = replace(zdp, measured=e_zdp.to_dict())
    measure = _CompiledSteps({zdp.plan_hash(): [0.051, 0.040], dp.plan_hash(): [0.050, 0.050]})
    chosen = compiled_choice(desc, device, picked, [(picked, e_zdp), (dp, e_dp)], measure, **_CHOICE)
    assert measure.calls == [[zdp.plan_hash(), dp.plan_hash()], [dp.plan_hash(), zdp.plan_hash()]]
    assert chosen.plan_hash() == zdp.plan_hash()
    record = chosen.calibration.compiled
    assert record["step_s"] == pytest.approx(0.0455) and all(f["repeats"] == 2 for f in record["finalists"])
    # far apart: measured once
    measure = _CompiledSteps({zdp.plan_hash(): [0.080], dp.plan_hash(): [0.050]})
    chosen = compiled_choice(desc, device, picked, [(picked, e_zdp), (dp, e_dp)], measure, **_CHOICE)
    assert len(measure.calls) == 1 and chosen.plan_hash() == dp.plan_hash()


def test_a_kept_finalist_over_its_limit_compiled_is_planned_again_for_that_memory():
    """[Note: compiled memory]: both finalists measured 3 MiB over the 64 MiB limit
    compiled (where eager they fitted): the faster (dp) is planned again at the limit
    less the model's error on it, that plan measured eager and compiled, and kept (it
    fits); were nothing to fit, the fastest is kept all the same, with a warning. (A
    measure whose compiled peaks are the limit's measure, as the allocator's on CUDA.)"""
    from osdp.compiled_choice import compiled_choice

    desc, device, zdp, dp = _plans()
    dp = replace(dp, batch_size=zdp.batch_size)
    e_zdp, e_dp = _eager(zdp, 0.080), _eager(dp, 0.085)
    picked = replace(zdp, measured=e_zdp.to_dict())
    over = zdp.memory_limit_bytes + 3 * 2**20
    finalists = {zdp.plan_hash(), dp.plan_hash()}
    measure = _CompiledSteps({zdp.plan_hash(): [0.080], dp.plan_hash(): [0.050]}, other=[0.060],
                             peak=lambda plan: over if plan.plan_hash() in finalists else 8e6)
    chosen = compiled_choice(desc, device, picked, [(picked, e_zdp), (dp, e_dp)], measure, **_CHOICE)
    corrected = chosen.plan_hash()
    assert corrected not in finalists and "planned for" in chosen.notes[-1]
    assert chosen.predicted.peak_bytes < dp.predicted.peak_bytes  # planned for less memory than dp
    assert measure.calls[1:] == [("eager", [corrected]), [corrected]]  # dp (faster) was the one corrected
    record = chosen.calibration.compiled
    assert record["kept"] == corrected and [f["plan"] for f in record["finalists"]][-1] == corrected
    assert Measurement.from_dict(chosen.measured) == _eager(chosen)
    # the corrected plan over its limit too: the fastest is kept, said so
    measure = _CompiledSteps({zdp.plan_hash(): [0.080], dp.plan_hash(): [0.050]}, other=[0.060],
                             peak=lambda plan: over)
    with _logged("no plan measured within the memory limit") as said:
        chosen = compiled_choice(desc, device, picked, [(picked, e_zdp), (dp, e_dp)], measure, **_CHOICE)
    rows = chosen.calibration.compiled["finalists"]
    assert len(rows) == 3 and said
    assert chosen.plan_hash() == max(rows, key=lambda f: f["samples_per_s"])["plan"]


class _logged:
    """A context collecting osdp.auto's warnings that contain ``text``: truthy once one was."""

    def __init__(self, text):
        import logging

        self.text, self.seen, self.logger = text, [], logging.getLogger("osdp.auto")

    def __enter__(self):
        import logging

        outer = self

        class Catch(logging.Handler):
            def emit(self, record):
                if outer.text in record.getMessage():
                    outer.seen.append(record)

        self.handler = Catch(level=logging.WARNING)
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)

    def __bool__(self):
        return bool(self.seen)
