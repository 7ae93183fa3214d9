"""Bad input to the planner and the CLI (issue 9): every case is one line on stderr with
exit status 2 from the CLI, a typed error from the API, and nothing written to disk.

Messages are compared against the exact text (or its stable parts); sizes against
hand-computed references."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

import osdp
import osdp.profiler
import osdp.planner
from osdp.cli import main
from osdp.errors import ConfigError, InfeasiblePlanError, OSDPError
from osdp.models import GPTConfig
from osdp.planner import planner as planner_mod
from osdp.planner import batch_sweep as scheduler_mod
from osdp.planner.cluster import PROFILE_DIR, load_cluster
from osdp.planner.cost_model import PlannerSettings, build_template
from osdp.planner.device import DeviceInfo
from osdp.planner.gpt_desc import describe_gpt
from osdp.planner.plan import Plan
from osdp.planner.planner import make_plan
from osdp.planner.run import RunSettings
from osdp.planner.batch_sweep import MAX_BATCH, min_memory_estimate, schedule
from osdp.sizes import byte_unit, format_bytes, parse_bytes

MiB, GiB = 2**20, 2**30
TINY = GPTConfig(vocab_size=256, seq_len=32, num_layers=3, hidden=64, heads=4)
UNITS_TEXT = "units: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"


def small_device(limit_bytes=48 * MiB, world=4):
    cluster = load_cluster("titan-rtx-pcie3").with_(constant_bytes=0)
    return cluster.for_run(RunSettings(world_size=world, memory_limit_bytes=limit_bytes))


def cli_error(argv, capsys) -> str:
    """Run the CLI, require exit status 2 and one line on stderr; return that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("osdp: error: ") and "Traceback" not in err, err
    return err.strip()


# ---- memory sizes need a unit; numbers in the API are bytes, bools are refused ---------
@pytest.mark.parametrize(
    "text,expected",
    [("8GiB", 8 * 2**30), ("8 gib", 8 * 2**30), ("16GB", 16e9), ("512MiB", 512 * 2**20), ("1.5KiB", 1536),
     ("3KB", 3000), ("2MB", 2e6), ("1TiB", 2**40), ("2TB", 2e12), ("100B", 100), ("1e3MiB", 1000 * 2**20)],
)
def test_sizes_with_a_unit_are_read(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("value,expected", [(8, 8.0), (8 * 2**30, 8.0 * 2**30), (1.5e9, 1.5e9)])
def test_numbers_are_bytes_in_the_api(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize(
    "value,message",
    [
        ("8", f"memory size '8' has no unit; write it like 8GiB or 8MiB ({UNITS_TEXT})"),
        ("1e99", f"memory size '1e99' has no unit; write it like 1e99GiB or 1e99MiB ({UNITS_TEXT})"),
        # not '0GiB', which is refused next (found by a helper)
        ("0", f"memory size '0' has no unit; write it like 8GiB or 8MiB ({UNITS_TEXT})"),
        ("8G", f"cannot read memory size '8G': unknown unit 'G' ({UNITS_TEXT})"),
        ("8XB", f"cannot read memory size '8XB': unknown unit 'XB' ({UNITS_TEXT})"),
        (True, "memory size must be a number of bytes or a string with a unit like '8GiB', got True (a bool)"),
        (float("nan"), "memory size must be finite, got nan"),
        (float("inf"), "memory size must be finite, got inf"),
        ("-1GiB", "memory size must be at least 1 byte, got '-1GiB'"),
        (0, "memory size must be at least 1 byte, got 0"),
        ([8], "memory size must be a number of bytes or a string with a unit like '8GiB', got [8] (a list)"),
    ],
)
def test_bad_sizes_are_refused(value, message):
    with pytest.raises(OSDPError) as info:
        parse_bytes(value)
    assert str(info.value) == message


def test_cli_memory_without_unit_is_refused(capsys):
    err = cli_error(["plan", "--preset", "tiny", "--memory", "8"], capsys)
    assert err == f"osdp: error: --memory: memory size '8' has no unit; write it like 8GiB or 8MiB ({UNITS_TEXT})"


def test_api_memory_limit_true_is_refused_before_profiling(tmp_path):
    # profile parses the limit first: nothing is measured or cached
    from osdp.models import GPT, example_batch

    config = GPTConfig(vocab_size=32, seq_len=8, num_layers=1, hidden=8, heads=2)
    with pytest.raises(OSDPError, match=r"^memory_limit: memory size must be a number of bytes .* got True \(a bool\)$"):
        osdp.profiler.profile(GPT(config), example_batch(config, 2), memory_limit=True, cache_dir=tmp_path)
    with pytest.raises(OSDPError, match=r"^memory_limit: memory size '8' has no unit"):
        osdp.profiler.profile(GPT(config), example_batch(config, 2), memory_limit="8", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


# ---- sizes are printed in the unit that fits them ------------------------------------
@pytest.mark.parametrize(
    "size,text",
    [(0, "0 B"), (8, "8 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (96 * MiB, "96.00 MiB"),
     (8 * GiB, "8.00 GiB"), (3 * 2**40, "3.00 TiB"), (1e99 * GiB, "9.77e+95 TiB")],
)
def test_format_bytes_picks_the_unit_by_size(size, text):
    assert format_bytes(size) == text


def test_byte_unit_matches_format_bytes():
    assert byte_unit(96 * MiB) == ("MiB", float(MiB))
    assert byte_unit(100) == ("B", 1.0)


def test_small_limits_do_not_read_as_zero_gib(capsys):
    err = cli_error(["plan", "--preset", "tiny", "--memory", "1KiB", "--backend", "python"], capsys)
    assert err.startswith("osdp: error: no plan fits in 1.00 KiB per device at batch 1: ")
    assert "0.00 GiB" not in err
    plan = make_plan(describe_gpt(TINY), small_device(24 * MiB), PlannerSettings(max_slices=4), backend="python")
    text = str(plan)
    assert "memory limit 24.00 MiB" in text and "0.00 GiB" not in text
    # the unit table prints each unit's weights in its own unit (a LayerNorm's 512 B)
    ln = next(u for u in plan.units if u.kind == "layernorm")
    assert f"{format_bytes(ln.param_bytes):>11}" in text and ln.param_bytes < 1024


def test_no_module_formats_bytes_by_hand():
    """Every size in a message goes through osdp.sizes.format_bytes (or byte_unit)."""
    root = Path(osdp.__file__).parent
    pattern = re.compile(r"/\s*(2\s*\*\*\s*(10|20|30|40)|1\s*<<\s*(10|20|30|40)|1e9|1024\s*\*\*)")
    offenders = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.name != "sizes.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


# ---- cluster JSON: every field checked, the file and the field named ------------------
def _cluster_file(tmp_path, **changes) -> Path:
    data = json.loads((PROFILE_DIR / "titan-rtx-pcie3.json").read_text())
    data.update(changes)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"flops_per_s": "fast"}, "flops_per_s must be a number > 0, got 'fast' (a str)"),
        ({"flops_per_s": 0}, "flops_per_s must be a number > 0, got 0"),
        ({"memory_limit_bytes": "8GiB"},
         "memory_limit_bytes must be a number > 0 (bytes per device, e.g. 8589934592 for 8 GiB), got '8GiB' (a str)"),
        ({"world_size": "8"}, "world_size must be an integer > 0 (data-parallel ranks), got '8' (a str)"),
        ({"world_size": True}, "world_size must be an integer > 0 (data-parallel ranks), got True (a bool)"),
        ({"op_overhead_s": -1}, "op_overhead_s must be a number >= 0, got -1"),
        ({"constant_bytes": None}, "constant_bytes must be a number >= 0, got None (a NoneType)"),
        ({"memory_bandwidth_bytes_per_s": 0}, "memory_bandwidth_bytes_per_s must be a number > 0, got 0"),
        ({"name": 5}, "name must be a string, got 5 (an int)"),
        ({"all_gather": {"alpha_s": "x", "beta_s_per_byte": 1e-9}}, "all_gather.alpha_s must be a number >= 0, got 'x' (a str)"),
        ({"reduce_scatter": {"alpha_s": 1e-5}}, "reduce_scatter lacks ['beta_s_per_byte']; it takes ['alpha_s', 'beta_s_per_byte']"),
        ({"all_gather": 5}, 'all_gather must be an object {"alpha_s": ..., "beta_s_per_byte": ...}, got 5 (an int)'),
        ({"split_efficiency": {"4": "x"}}, "split_efficiency['4'] must be a number > 0, got 'x' (a str)"),
        ({"split_efficiency": {"four": 1.0}}, "split_efficiency keys are slice counts like \"4\", got 'four'"),
        ({"op_compute": {"k": {"fwd_intercept_s": "a", "fwd_per_sample_s": 1}}},
         "op_compute['k'].fwd_intercept_s must be a number >= 0, got 'a' (a str)"),
    ],
)
def test_cluster_file_fields_are_checked(tmp_path, capsys, changes, message):
    path = _cluster_file(tmp_path, **changes)
    with pytest.raises(OSDPError) as info:
        load_cluster(str(path))
    assert str(info.value) == f"cluster file {path}: {message}"
    err = cli_error(["plan", "--preset", "tiny", "--cluster", str(path)], capsys)
    assert err == f"osdp: error: cluster file {path}: {message}"


def test_cluster_nan_is_refused(tmp_path):
    path = tmp_path / "c.json"
    data = json.loads((PROFILE_DIR / "titan-rtx-pcie3.json").read_text())
    data["flops_per_s"] = float("nan")
    path.write_text(json.dumps(data))  # json writes NaN, and reads it back
    with pytest.raises(OSDPError, match=re.escape(f"cluster file {path}: flops_per_s must be a number > 0, got nan")):
        load_cluster(str(path))


def test_device_info_refuses_bools_in_the_api():
    base = load_cluster("titan-rtx-pcie3")
    with pytest.raises(OSDPError, match=r"memory_limit_bytes must be a number > 0 .* got True \(a bool\)"):
        base.for_run(RunSettings(world_size=8, memory_limit_bytes=True))
    with pytest.raises(OSDPError, match=r"^device description: world_size must be an integer > 0 \(data-parallel "
                                        r"ranks\), got 2.0 \(a float\)$"):
        DeviceInfo.from_dict(dict(base.for_run(RunSettings(world_size=8)).to_dict(), world_size=2.0))


def test_cluster_directory_is_refused(tmp_path, capsys):
    err = cli_error(["plan", "--preset", "tiny", "--cluster", str(tmp_path)], capsys)
    assert err == f"osdp: error: cluster {str(tmp_path)!r} is a directory; give a cluster JSON file or a profile name"


# ---- model flags ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value,bad",
    [("1,x", "x"), (",,", ""), ("64,-64", "-64"), ("0,64", "0"), ("64;64", "64;64")],
)
def test_block_hidden_must_be_positive_integers(capsys, value, bad):
    err = cli_error(["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--block-hidden", value], capsys)
    assert err == (f"osdp: error: --block-hidden takes comma-separated positive integers (one width per block, "
                   f"e.g. 1024,4096,1024), got {value!r} ({bad!r} is not one)")


def test_gpt_config_refuses_zero_widths_and_bools():
    with pytest.raises(ConfigError, match=r"GPTConfig.block_hidden\[0\] must be a positive integer, got 0"):
        GPTConfig(num_layers=2, hidden=64, heads=4, block_hidden=(0, 64))
    with pytest.raises(ConfigError, match=r"GPTConfig.num_layers must be a positive integer, got True"):
        GPTConfig(num_layers=True)


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(max_slices=True), r"max slices must be a positive integer, got True"),
        (dict(accumulation_steps=True), r"accumulation steps must be a positive integer, got True"),
        (dict(prefetch_bytes=float("nan")), r"prefetch window must be a number of bytes >= 0 \(or None\), got nan"),
        (dict(memory_tolerance=0.0), r"memory_tolerance must be a fraction of the budget in \(0, 1\), got 0.0"),
        (dict(min_buckets=0), r"min_buckets must be a positive integer, got 0"),
        (dict(param_dtype_bytes=True), r"param_dtype_bytes must be 1, 2, 4 or 8 bytes, got True"),
    ],
)
def test_planner_settings_refuse_wrong_types(changes, match):
    with pytest.raises(OSDPError, match=match):
        PlannerSettings(**changes)


# ---- output paths ------------------------------------------------------------------------
def test_json_into_a_missing_directory_names_the_directory(tmp_path, capsys):
    target = tmp_path / "missing" / "p.json"
    err = cli_error(["plan", "--preset", "tiny", "--memory", "1GiB", "--json", str(target)], capsys)
    assert err == (f"osdp: error: --json: cannot write the plan to {target}: directory {target.parent} "
                   "does not exist (create it first)")
    assert list(tmp_path.iterdir()) == []
    png = tmp_path / "missing" / "p.png"
    err = cli_error(["plan", "--preset", "tiny", "--memory", "1GiB", "--plot", str(png)], capsys)
    assert err == (f"osdp: error: --plot: cannot write the plot to {png}: directory {png.parent} "
                   "does not exist (create it first)")
    plan = make_plan(describe_gpt(TINY), small_device(), PlannerSettings(max_slices=4), backend="python")
    with pytest.raises(OSDPError, match=re.escape(f"directory {target.parent} does not exist")):
        plan.save(target)
    with pytest.raises(OSDPError, match=re.escape(f"cannot write the plan to {tmp_path}: it is a directory")):
        plan.save(tmp_path)
    assert list(tmp_path.iterdir()) == []


# ---- plan files: every field checked -----------------------------------------------------
@pytest.fixture(scope="module")
def plan_dict():
    plan = make_plan(describe_gpt(TINY), small_device(), PlannerSettings(max_slices=4), backend="python")
    return json.loads(json.dumps(plan.to_dict()))


def _unit_index(data, kind="linear"):
    return next(i for i, u in enumerate(data["units"]) if u["kind"] == kind)


def test_plan_round_trips_with_slices(plan_dict):
    plan = Plan.from_dict(plan_dict)
    assert all(u["slices"] == len(u["modes"]) for u in plan_dict["units"])
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_plan_edited_to_another_slice_count_is_refused(plan_dict, tmp_path, capsys):
    data = json.loads(json.dumps(plan_dict))
    i = _unit_index(data)
    unit = data["units"][i]
    unit["modes"] = unit["modes"] + ["zdp"]  # one more slice mode; 'slices' left as it was
    message = (f"plan field units[{i}] ({unit['name']}).modes lists {len(unit['modes'])} slice modes but "
               f"units[{i}] ({unit['name']}).slices is {unit['slices']}: a unit's slice count is the length of its "
               "modes; change both (or make a new plan)")
    with pytest.raises(OSDPError) as info:
        Plan.from_dict(data)
    assert str(info.value) == message
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    err = cli_error(["plan", "--plan", str(path)], capsys)
    assert err == f"osdp: error: plan file {path}: {message}"


def test_plan_with_more_slices_than_its_settings_allow_is_refused(plan_dict):
    data = json.loads(json.dumps(plan_dict))
    i = _unit_index(data)
    data["units"][i].update(modes=["zdp"] * 8, slices=8)
    with pytest.raises(OSDPError, match=re.escape(
            f"units[{i}] ({data['units'][i]['name']}).modes lists 8 slices, more than the plan's "
            "settings.max_slices = 4")):
        Plan.from_dict(data)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("batch_size", 0, "plan field 'batch_size' must be an integer >= 1, got 0"),
        ("batch_size", "8", "plan field 'batch_size' must be an integer >= 1, got '8'"),
        ("batch_size", True, "plan field 'batch_size' must be an integer >= 1, got True"),
        ("world_size", -1, "plan field 'world_size' must be an integer >= 1, got -1"),
        ("accumulation_steps", 0, "plan field 'accumulation_steps' must be an integer >= 1, got 0"),
        ("prefetch_bytes", -5, "plan field 'prefetch_bytes' must be an integer >= 0, got -5"),
        ("memory_limit_bytes", float("nan"), "plan field 'memory_limit_bytes' must be a number > 0, got nan"),
        ("gradient_sync", "sometimes", "plan field 'gradient_sync' must be 'every' or 'last', got 'sometimes'"),
        ("units", {}, "plan field 'units' must be a list, got {} (a dict)"),
        ("checkpoint_blocks", "blocks.0", "plan field 'checkpoint_blocks' must be a list of module paths, got 'blocks.0' (a str)"),
        ("bogus", 1, "plan has unknown fields ['bogus']"),
    ],
)
def test_plan_fields_are_checked(plan_dict, field, value, message):
    data = dict(plan_dict, **{field: value})
    with pytest.raises(OSDPError) as info:
        Plan.from_dict(data)
    assert str(info.value).startswith(message)


def test_plan_missing_field_is_named(plan_dict):
    data = {k: v for k, v in plan_dict.items() if k != "units"}
    with pytest.raises(OSDPError, match=r"^plan field 'units' is missing$"):
        Plan.from_dict(data)


def test_plan_path_that_is_a_directory(tmp_path, capsys):
    err = cli_error(["plan", "--plan", str(tmp_path)], capsys)
    assert err == f"osdp: error: plan file {tmp_path} is a directory; give the plan's JSON file"


# ---- huge limits: the sweep is bounded, capped with a note --------------------------------
def _count_calls(monkeypatch, module, name, limit):
    calls = {"n": 0}
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > limit:
            raise AssertionError(f"{name} called more than {limit} times")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_huge_memory_limit_sweep_is_bounded_and_capped(monkeypatch):
    desc = describe_gpt(TINY)
    searches = _count_calls(monkeypatch, scheduler_mod, "search", 2 * 21 + 4)
    # the feasibility probes: search.feasible's one pass, counted as the searches they were
    probes = _count_calls(monkeypatch, scheduler_mod, "feasible", 2 * 21 + 4)
    bounds = _count_calls(monkeypatch, scheduler_mod, "_time_lower_bound", 2 * 21 + 4)
    best = schedule(desc, small_device(1e30), PlannerSettings(max_slices=4), backend="python")
    assert best.batch == MAX_BATCH and best.batch_capped
    runs = searches["n"] + probes["n"]
    assert runs == best.searches <= 2 * 21 + 4 and bounds["n"] <= runs


def test_huge_memory_limit_plan_says_it_is_capped(capsys):
    assert main(["plan", "--preset", "tiny", "--memory", "1e99GiB", "--backend", "python"]) == 0
    out = capsys.readouterr().out
    assert (f"note: the batch sweep stops at {MAX_BATCH} samples per device (MAX_BATCH): that batch fits in "
            f"{format_bytes(1e99 * GiB)} and larger ones may too") in out


def test_ordinary_sweep_is_not_capped():
    best = schedule(describe_gpt(TINY), small_device(), PlannerSettings(max_slices=4), backend="python")
    assert not best.batch_capped and best.batch < MAX_BATCH


def test_given_batch_evaluates_baselines_at_that_batch_without_sweeping(monkeypatch):
    swept = []
    real = planner_mod.schedule

    def recording(*args, **kwargs):
        swept.append(kwargs.get("batch"))
        return real(*args, **kwargs)

    monkeypatch.setattr(planner_mod, "schedule", recording)
    plan = make_plan(describe_gpt(TINY), small_device(), PlannerSettings(max_slices=4), batch=3, backend="python")
    assert swept == [3, 3, 3, 3]  # the plan and the three baselines (FSDP, shard-grad-op, DDP), none swept
    assert {b.batch_size for b in plan.baselines.values() if b is not None} <= {3}
    assert plan.baselines["fsdp"] is not None and plan.baselines["fsdp"].batch_size == 3
    assert "the FSDP baselines are evaluated at the same batch 3/device" in str(plan)


def test_huge_global_batch_does_not_walk_every_candidate(monkeypatch):
    """A prime global batch share has two divisors; finding them takes sqrt(n) steps."""
    ranges = []
    real_range = range

    def guarded(*args):
        r = real_range(*args)
        assert len(r) <= 10**5, f"range of {len(r)} candidates"
        ranges.append(len(r))
        return r

    monkeypatch.setattr(scheduler_mod, "range", guarded, raising=False)
    prime = 2_147_483_647
    assert scheduler_mod._divisors(prime) == [1, prime]
    assert scheduler_mod._divisors(36) == [d for d in real_range(1, 37) if 36 % d == 0]
    with pytest.raises(InfeasiblePlanError):
        schedule(describe_gpt(TINY), small_device(1 * MiB, world=1), PlannerSettings(max_slices=4),
                 backend="python", global_batch=prime)


# ---- advice when gradient accumulators make a plan infeasible -----------------------------
def test_accumulators_advice_names_gradient_sync_every():
    desc = describe_gpt(TINY)
    settings = PlannerSettings(max_slices=4, accumulation_steps=4, gradient_sync="last")
    probe = small_device(1e12)
    last = min_memory_estimate(build_template(desc, probe, settings), 1).peak_bytes
    every = min_memory_estimate(build_template(desc, probe, settings.with_(gradient_sync="every")), 1).peak_bytes
    assert every < last
    limit = math.floor((every + last) / 2)  # fits without the accumulators, not with them
    # (the prefetch window, and with it the least-memory plan, depends on the limit: reference at this limit)
    every = min_memory_estimate(build_template(desc, small_device(limit), settings.with_(gradient_sync="every")),
                                1).peak_bytes
    with pytest.raises(InfeasiblePlanError) as info:
        schedule(desc, small_device(limit), settings, batch=1, backend="python")
    text = str(info.value)
    accumulators = info.value.breakdown["grad_accumulators"]
    assert text.endswith(
        f"reduce gradients after every micro-batch (--gradient-sync every; in the API "
        f"PlannerSettings(gradient_sync='every')), which frees the {format_bytes(accumulators)} of unsharded gradient "
        f"accumulators that gradient_sync='last' keeps across the 4 micro-batches; with that the least-memory plan "
        f"needs {format_bytes(every)}, within the {format_bytes(limit)} limit")
    assert "raise the memory limit" not in text
    # the advice is right: the same request with gradient_sync='every' plans
    assert schedule(desc, small_device(limit), settings.with_(gradient_sync="every"), batch=1, backend="python")


def test_accumulators_advice_on_the_cli(capsys):
    err = cli_error(["plan", "--preset", "nd-48x1024", "--memory", "5GiB", "--global-batch", "64",
                     "--world-size", "8"], capsys)
    assert "reduce gradients after every micro-batch (--gradient-sync every;" in err
    assert "within the 5.00 GiB limit" in err and "raise the memory limit" not in err


# ---- the torch names osdp uses are the current ones ---------------------------------------
def test_profiling_collectives_warns_nothing():
    """The profiler's all-gather/reduce-scatter go through the same names as the runtime's
    (torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor with a
    FutureWarning). Runs on a 2-rank fake process group in a fresh process."""
    code = (
        "import warnings, torch.distributed as dist\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=2)\n"
        "import osdp.profiler.hardware as P\n"
        "warnings.simplefilter('error')\n"
        "P.profile_collectives(None, sizes=(4096,), repeats=1)\n"
        "import os; os.environ['OSDP_GLOO_REDUCE_SCATTER'] = '1'\n"
        "P.profile_collectives(None, sizes=(4096,), repeats=1)\n"
        "print('ok')\n"
    )
    root = Path(osdp.__file__).parent.parent
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-W", "error::FutureWarning", "-c", code],
                          capture_output=True, text=True, cwd=root, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_cli_negative_memory_is_the_memory_check_not_an_argparse_error(capsys):
    # '-1GiB' starts with '-': argparse took it for the next option ("expected one argument")
    err = cli_error(["plan", "--preset", "tiny", "--memory", "-1GiB"], capsys)
    assert err == "osdp: error: --memory: memory size must be at least 1 byte, got '-1GiB'"
