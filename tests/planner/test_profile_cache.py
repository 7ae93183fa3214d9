"""The profile cache ([Note: profile cache] in osdp/planner/profile_cache.py): keys,
expiry, the speed check, noise re-measures (a scripted timer), the reprofile flag and
env, corrupt files."""
import json
import socket
import warnings

import pytest
import torch

from osdp.cli import build_parser
from osdp.errors import NoisyProfileWarning, OSDPError, ProfileCacheWarning
from osdp.planner import profile_cache as pc
from osdp.planner.profile_cache import ProfileCache, machine_key, spread, steady, timed_samples


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("OSDP_REPROFILE", "OSDP_CACHE_DIR", "OSDP_PROFILE_MAX_AGE_S", "OSDP_PROFILE_NOISE",
                 "OSDP_PROFILE_SPEED_TOLERANCE"):
        monkeypatch.delenv(name, raising=False)


class Machine:
    """The profiler's machine_speed, scripted: ``speeds`` in GFLOP/s, one per call (the
    last one repeated)."""

    def __init__(self, *speeds, noisy=False):
        self.speeds, self.noisy, self.calls = list(speeds), noisy, 0

    def __call__(self, device):
        speed = self.speeds[min(self.calls, len(self.speeds) - 1)]
        self.calls += 1
        return pc.Speed(speed * 1e9, self.noisy)


def _tiny_gpt():
    from osdp.models import GPT, example_batch, get_preset

    config = get_preset("tiny")
    torch.manual_seed(0)
    return GPT(config), example_batch(config, 2)


def _counting_compute(monkeypatch):
    """The profiler with its unit timing counted: the list grows by one per timing."""
    from osdp.profiler import hardware as prof

    calls, real = [], prof.profile_compute

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(prof, "profile_compute", counting)
    return calls


# ---- keys and location -----------------------------------------------------------------

def test_machine_key_names_host_processor_torch_dtype_and_backend():
    key = machine_key(torch.device("cpu"), torch.float32, "gloo")
    assert f"host={socket.gethostname()}|" in key
    assert f"|torch={torch.__version__}|" in key and "|dtype=torch.float32|" in key and key.endswith("|backend=gloo")
    assert f"x{__import__('os').cpu_count()}" in key  # the processor with its core count
    # each part changes the key
    assert machine_key("cpu", torch.bfloat16, "gloo") != key
    assert machine_key("cpu", torch.float32, "none") != key


def test_an_entry_is_only_read_under_its_own_key(tmp_path):
    cache = ProfileCache.open(tmp_path)
    key = machine_key("cpu", "torch.float32", "gloo")
    cache.put("compute", f"{key}|linear:10", {"fwd": 1.0})
    cache.save()
    again = ProfileCache.open(tmp_path)
    assert again.get("compute", f"{key}|linear:10") == {"fwd": 1.0}
    assert again.get("compute", f"{machine_key('cpu', 'torch.float16', 'gloo')}|linear:10") is None
    assert again.get("compute", key.replace(f"torch={torch.__version__}", "torch=2.0.0") + "|linear:10") is None


def test_the_cache_lives_in_the_argument_else_the_env_else_home(tmp_path, monkeypatch):
    assert pc.cache_path(tmp_path) == tmp_path / "profile-cache.json"
    monkeypatch.setenv("OSDP_CACHE_DIR", str(tmp_path / "env"))
    assert pc.cache_path() == tmp_path / "env" / "profile-cache.json"
    monkeypatch.delenv("OSDP_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert pc.cache_path() == tmp_path / "home" / ".cache" / "osdp" / "profile-cache.json"


# ---- expiry ---------------------------------------------------------------------------------

def test_entries_expire_after_max_age_and_are_dropped_at_save(tmp_path):
    clock = Clock()
    cache = ProfileCache.open(tmp_path, max_age_s=100, now=clock)
    cache.put("comm", "k-old", 1)
    clock.t += 60
    cache.put("comm", "k-new", 2)
    cache.save()
    clock.t += 50  # k-old is 110 s old, k-new 50 s
    again = ProfileCache.open(tmp_path, max_age_s=100, now=clock)
    assert again.get("comm", "k-old") is None and again.get("comm", "k-new") == 2
    again.save()
    assert set(json.loads(pc.cache_path(tmp_path).read_text())["comm"]) == {"k-new"}


def test_max_age_from_the_env(tmp_path, monkeypatch):
    clock = Clock()
    cache = ProfileCache.open(tmp_path, now=clock)
    cache.put("split", "k", 1)
    cache.save()
    clock.t += 10
    assert ProfileCache.open(tmp_path, now=clock).get("split", "k") == 1  # default: 7 days
    monkeypatch.setenv("OSDP_PROFILE_MAX_AGE_S", "5")
    assert ProfileCache.open(tmp_path, now=clock).get("split", "k") is None
    monkeypatch.setenv("OSDP_PROFILE_MAX_AGE_S", "a week")
    with pytest.raises(OSDPError, match="OSDP_PROFILE_MAX_AGE_S must be a number"):
        ProfileCache.open(tmp_path)


# ---- reprofile -----------------------------------------------------------------------------

def test_reprofile_flag_and_env_read_nothing_but_still_write(tmp_path, monkeypatch):
    cache = ProfileCache.open(tmp_path)
    cache.put("comm", "k", 1)
    cache.save()
    fresh = ProfileCache.open(tmp_path, reprofile=True)
    assert fresh.get("comm", "k") is None
    fresh.put("comm", "k", 2)
    fresh.save()
    assert ProfileCache.open(tmp_path).get("comm", "k") == 2
    monkeypatch.setenv("OSDP_REPROFILE", "1")
    assert ProfileCache.open(tmp_path).get("comm", "k") is None
    monkeypatch.setenv("OSDP_REPROFILE", "0")
    assert ProfileCache.open(tmp_path).get("comm", "k") == 2


def test_demo_has_a_reprofile_flag():
    assert build_parser().parse_args(["demo", "--reprofile"]).reprofile is True
    assert build_parser().parse_args(["demo"]).reprofile is False


def test_profile_bypasses_the_cache_when_reprofiling(tmp_path, monkeypatch, one_rank_group):
    """The profiler itself: a second profile reads the cache (no compute measured),
    a reprofile measures again."""
    from osdp.profiler import hardware as prof

    monkeypatch.setattr(pc, "machine_speed", Machine(100))  # one speed: the speed check passes
    model, inputs = _tiny_gpt()
    kwargs = dict(cache_dir=tmp_path, repeats=1, progress=False, memory_limit="64MiB", batches=(1, 2))
    prof.profile(model, inputs, **kwargs)
    calls = _counting_compute(monkeypatch)
    prof.profile(model, inputs, **kwargs)
    assert calls == []
    prof.profile(model, inputs, reprofile=True, **kwargs)
    assert calls == [1]
    monkeypatch.setenv("OSDP_REPROFILE", "1")
    prof.profile(model, inputs, **kwargs)
    assert calls == [1, 1]


# ---- speed --------------------------------------------------------------------------------

def test_an_entry_is_read_only_at_the_speed_it_was_measured_at(tmp_path, monkeypatch):
    cache = ProfileCache.open(tmp_path, speed=100.0)
    cache.put("compute", "k", 1)
    cache.save()
    assert json.loads(pc.cache_path(tmp_path).read_text())["compute"]["k"]["speed"] == 100.0
    assert ProfileCache.open(tmp_path, speed=124.0).get("compute", "k") == 1  # within 25%
    assert ProfileCache.open(tmp_path, speed=81.0).get("compute", "k") == 1
    faster = ProfileCache.open(tmp_path, speed=130.0)  # quieter now: it was measured under load
    assert faster.get("compute", "k") is None and faster.stale_speeds == [100.0]
    faster.save()
    assert ProfileCache.open(tmp_path, speed=100.0).get("compute", "k") == 1  # kept for a run at its speed
    assert ProfileCache.open(tmp_path, speed=70.0).get("compute", "k") is None  # busier now
    assert ProfileCache.open(tmp_path).get("compute", "k") == 1  # no speed: no check
    monkeypatch.setenv("OSDP_PROFILE_SPEED_TOLERANCE", "0.5")
    assert ProfileCache.open(tmp_path, speed=140.0).get("compute", "k") == 1
    monkeypatch.setenv("OSDP_PROFILE_SPEED_TOLERANCE", "fast")
    with pytest.raises(OSDPError, match=r"OSDP_PROFILE_SPEED_TOLERANCE must be a number, got 'fast'"):
        ProfileCache.open(tmp_path, speed=100.0)


def test_an_entry_without_a_speed_stamp_is_measured_again(tmp_path):
    """An entry an older osdp wrote (no stamp) is not trusted by a cache that knows its
    speed; a malformed stamp is dropped as a malformed entry."""
    path = pc.cache_path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": pc.CACHE_VERSION, "comm": {}, "split": {}, "compute": {
        "old": {"value": 1, "saved_s": 1e12}, "bad": {"value": 2, "saved_s": 1e12, "speed": "fast"}}}))
    assert ProfileCache.open(tmp_path, speed=100.0, now=Clock(1e12)).get("compute", "old") is None
    assert ProfileCache.open(tmp_path, now=Clock(1e12)).get("compute", "old") == 1
    assert ProfileCache.open(tmp_path, now=Clock(1e12)).get("compute", "bad") is None


def test_machine_speed_is_the_reference_matmul_rate_and_reports_noise():
    side = pc.SPEED_MATMUL_SIDE_DEFAULT
    timer = ScriptedTimer([9.0] + [0.01] * 5)
    assert pc.machine_speed("cpu", timer=timer) == pc.Speed(pytest.approx(2 * side**3 / 0.01), False)
    noisy = ScriptedTimer(([9.0] + [0.01, 0.03, 0.01, 0.01, 0.01]) * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # noise is reported in Speed, not warned: the profiler decides
        speed = pc.machine_speed("cpu", timer=noisy)
    assert speed.noisy and speed.flops_per_s == pytest.approx(2 * side**3 / 0.01)
    torch.manual_seed(1)
    draws = torch.rand(3)
    torch.manual_seed(1)
    real = pc.machine_speed("cpu", repeats=2)
    assert real.flops_per_s > 1e6  # a real matmul on this machine, timed
    assert torch.equal(torch.rand(3), draws)  # the global random stream untouched (ranks seed their weights)


def test_profile_measures_again_what_was_cached_at_another_speed(tmp_path, monkeypatch, one_rank_group):
    """A cache filled on a busy machine (half speed) is not read on a quiet one: the
    compute is timed again and cached with the new stamp, which a second quiet
    profile reads."""
    from osdp.profiler import hardware as prof

    model, inputs = _tiny_gpt()
    kwargs = dict(cache_dir=tmp_path, repeats=1, progress=False, memory_limit="64MiB", batches=(2,))
    monkeypatch.setattr(pc, "machine_speed", Machine(50))
    prof.profile(model, inputs, **kwargs)
    stamps = {e["speed"] for e in json.loads(pc.cache_path(tmp_path).read_text())["compute"].values()}
    assert stamps == {50e9}
    calls = _counting_compute(monkeypatch)
    monkeypatch.setattr(pc, "machine_speed", Machine(100))
    prof.profile(model, inputs, **kwargs)
    assert calls == [1]
    stamps = {e["speed"] for e in json.loads(pc.cache_path(tmp_path).read_text())["compute"].values()}
    assert stamps == {100e9}
    prof.profile(model, inputs, **kwargs)
    assert calls == [1]


@pytest.mark.parametrize("machine, why", [(Machine(100, 60), "changed"), (Machine(100, noisy=True), "stayed noisy")])
def test_a_profile_through_a_change_of_speed_is_used_but_not_cached(tmp_path, monkeypatch, one_rank_group,
                                                                     machine, why):
    from osdp.profiler import hardware as prof

    model, inputs = _tiny_gpt()
    monkeypatch.setattr(pc, "machine_speed", machine)
    with pytest.warns(NoisyProfileWarning, match=rf"this machine's speed {why} while profiling .* not cached"):
        desc, cluster, run = prof.profile(model, inputs, cache_dir=tmp_path, repeats=1, progress=False,
                                          memory_limit="64MiB", batches=(2,))
    assert cluster.to_dict()["op_compute"]  # measured and used
    assert not pc.cache_path(tmp_path).exists()
    assert machine.calls == 2  # before reading the cache, and before writing it


def test_no_cache_no_speed_measured(tmp_path, monkeypatch, one_rank_group):
    from osdp.profiler import hardware as prof

    machine = Machine(100)
    monkeypatch.setattr(pc, "machine_speed", machine)
    model, inputs = _tiny_gpt()
    prof.profile(model, inputs, cache_dir=tmp_path, use_cache=False, repeats=1, progress=False,
                 memory_limit="64MiB", batches=(2,))
    assert machine.calls == 0 and not pc.cache_path(tmp_path).exists()


def test_a_measured_plan_is_read_only_at_the_speed_it_was_measured_at(tmp_path, monkeypatch):
    """[Note: measured plan cache]: auto mode's plan carries the stamp; a plan measured
    while the speed changed is not cached; an older file without a stamp is measured
    again."""
    from osdp.measured_plans import MeasuredPlans
    from osdp.models import get_preset
    from osdp.planner import describe_gpt, load_cluster, make_plan
    from osdp.planner.cluster import RunSettings
    from osdp.planner.cost_model import PlannerSettings

    device = load_cluster("titan-rtx-pcie3").for_run(RunSettings(world_size=2, memory_limit_bytes=2**30))
    plan = make_plan(describe_gpt(get_preset("tiny")), device, PlannerSettings(policy="zdp"), backend="python",
                     baselines=False)

    def cache_at(*speeds):
        monkeypatch.setattr(pc, "machine_speed", Machine(*speeds))
        return MeasuredPlans(tmp_path)

    cache = cache_at(50, 60)  # 20% apart: steady; stamped with the slower
    assert cache.get("k") is None
    cache.put("k", plan)
    assert json.loads((tmp_path / "plans" / "k.json").read_text())["speed_flops_per_s"] == 50e9
    assert cache_at(55).get("k").plan_hash() == plan.plan_hash()
    assert cache_at(100).get("k") is None  # quieter now
    changed = cache_at(100, 50)
    assert changed.get("k") is None
    with pytest.warns(NoisyProfileWarning, match="speed changed while auto mode measured its plans"):
        changed.put("k", plan)
    assert cache_at(50).get("k") is not None  # the old plan stays
    plan.save(str(tmp_path / "plans" / "old.json"))  # the format before the stamp
    assert cache_at(50).get("old") is None
    off = cache_at(50)
    off.enabled = False
    assert off.get("k") is None and pc.machine_speed.calls == 0  # disabled: nothing timed


# ---- noise ---------------------------------------------------------------------------------

class ScriptedTimer:
    """A perf_counter whose successive timed intervals are scripted."""

    def __init__(self, intervals):
        self.intervals = list(intervals)
        self.t = 0.0
        self.starting = True

    def __call__(self):
        if self.starting:
            self.starting = False
        else:
            self.t += self.intervals.pop(0)
            self.starting = True
        return self.t


def test_timed_samples_drop_the_warm_up_and_read_the_timer():
    timer = ScriptedTimer([9.0, 1.0, 2.0, 3.0])
    assert timed_samples(lambda: None, 3, timer=timer) == [1.0, 2.0, 3.0]
    assert spread([1.0, 2.0, 3.0]) == 1.0


def test_a_noisy_measurement_is_measured_again_until_steady():
    # attempt 1: 1, 2, 1 (spread 100%); attempt 2: 1.0, 1.05, 1.0 (5%)
    timer = ScriptedTimer([5, 1, 2, 1] + [5, 1.0, 1.05, 1.0])
    measured = []

    def measure():
        measured.append(1)
        return timed_samples(lambda: None, 3, timer=timer)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a steady result warns nothing
        kept = steady(measure, "all_gather of 4 KiB", threshold=0.2, retries=2)
    assert len(measured) == 2 and kept.attempts == 2 and kept.index == 1
    assert not kept.noisy and kept.samples == pytest.approx((1.0, 1.05, 1.0))


def test_a_measurement_that_stays_noisy_warns_how_noisy_after_bounded_retries():
    timer = ScriptedTimer([5, 1, 3, 1] + [5, 1, 2, 1] + [5, 1, 4, 1] + [5, 1, 1, 1])
    measured = []

    def measure():
        measured.append(1)
        return timed_samples(lambda: None, 3, timer=timer)

    with pytest.warns(NoisyProfileWarning, match=r"compute at batch 4 stayed noisy: its 3 repeats spread 100%.*"
                                                 r"after 2 re-measures, above the 20% threshold"):
        kept = steady(measure, "compute at batch 4", threshold=0.2, retries=2)
    assert len(measured) == 3  # 1 + 2 retries, never more
    assert kept.noisy and kept.index == 1 and kept.spread == 1.0  # the steadiest attempt


def test_noisy_profile_measurements_are_not_cached(tmp_path, monkeypatch, one_rank_group):
    """The profiler: a compute measurement that stays noisy is used but not cached, so
    the next profile measures it again."""
    from osdp.profiler import hardware as prof

    monkeypatch.setattr(pc, "machine_speed", Machine(100))
    model, inputs = _tiny_gpt()
    kwargs = dict(cache_dir=tmp_path, repeats=2, progress=False, memory_limit="64MiB", batches=(2,))
    monkeypatch.setenv("OSDP_PROFILE_NOISE", "0")  # every spread above 0 is noise
    monkeypatch.setattr(prof, "steady", lambda measure, what, **k: pc.steady(measure, what, retries=0, **k))
    with pytest.warns(NoisyProfileWarning):
        prof.profile(model, inputs, **kwargs)
    assert ProfileCache.open(tmp_path).sections["compute"] == {}
    monkeypatch.setenv("OSDP_PROFILE_NOISE", "1000")  # now nothing is noise: cached
    prof.profile(model, inputs, **kwargs)
    assert json.loads(pc.cache_path(tmp_path).read_text())["compute"]


# ---- corrupt files --------------------------------------------------------------------------

@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"version": 1, "comm": {}}',
                                     '{"version": 3, "comm": []}', "\x00\x01binary"])
def test_a_corrupt_cache_is_ignored_with_a_warning_and_rewritten(tmp_path, content):
    path = pc.cache_path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    with pytest.warns(ProfileCacheWarning, match="ignored, measuring again"):
        cache = ProfileCache.open(tmp_path)
    assert cache.get("comm", "k") is None
    cache.put("comm", "k", 7)
    cache.save()
    assert ProfileCache.open(tmp_path).get("comm", "k") == 7
    assert [p.name for p in path.parent.iterdir()] == ["profile-cache.json"]  # no temporary left


def test_malformed_entries_are_dropped_and_good_ones_kept(tmp_path):
    path = pc.cache_path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": pc.CACHE_VERSION, "comm": {"bad": 3, "good": {"value": 1, "saved_s": 1e12}},
                                "compute": {}, "split": {}}))
    cache = ProfileCache.open(tmp_path, now=Clock(1e12))
    assert cache.get("comm", "good") == 1 and cache.get("comm", "bad") is None
    cache.save()
    assert set(json.loads(path.read_text())["comm"]) == {"good"}


def test_profile_survives_a_corrupt_cache(tmp_path, monkeypatch, one_rank_group):
    from osdp.profiler import hardware as prof

    monkeypatch.setattr(pc, "machine_speed", Machine(100))
    pc.cache_path(tmp_path).parent.mkdir(parents=True, exist_ok=True)
    pc.cache_path(tmp_path).write_text('{"version": 3, "compute": ')
    with pytest.warns(ProfileCacheWarning):
        prof.profile(*_tiny_gpt(), cache_dir=tmp_path, repeats=1, progress=False, memory_limit="64MiB",
                     batches=(2,))
    assert json.loads(pc.cache_path(tmp_path).read_text())["compute"]
